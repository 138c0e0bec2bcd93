// node_cluster.js ADDR WORKERS [rr|shared] -- Node's cluster module,
// unmodified; each worker is a new node process (fork + exec) that echoes.
// rr (round-robin, Node's default on Linux): the primary accepts every
// connection and passes it to a worker over the IPC channel (SCM_RIGHTS).
// shared (SCHED_NONE): the primary binds the socket, without listening, and
// sends it to every worker, which listen()s and accepts on it itself.
// Prints "PORT n" once every worker listens; stops on SIGTERM.
const cluster = require('node:cluster');
const net = require('node:net');
const [addr, workers, mode] =
  [process.argv[2] || '10.77.0.1', Number(process.argv[3] || 2), process.argv[4] || 'rr'];
cluster.schedulingPolicy = mode === 'shared' ? cluster.SCHED_NONE : cluster.SCHED_RR;
if (cluster.isPrimary) {
  let ready = 0;
  cluster.setupPrimary({ args: [addr, String(workers), mode] });
  for (let i = 0; i < workers; i++) cluster.fork();
  cluster.on('listening', (w, a) => {
    if (++ready === workers) console.log('PORT ' + a.port);
  });
  process.on('SIGTERM', () => {
    for (const id in cluster.workers) cluster.workers[id].process.kill('SIGTERM');
    process.exit(0);
  });
} else {
  const served = { n: 0 };
  net.createServer((s) => {
    served.n++;
    s.on('data', (b) => s.write(b));
    s.on('end', () => s.end());
    s.on('error', () => s.destroy());
  }).listen({ host: addr, port: Number(process.env.NODE_CLUSTER_PORT || 0) });
}
