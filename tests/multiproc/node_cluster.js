// node_cluster.js ADDR WORKERS -- Node's cluster module, unmodified: the
// primary accepts every connection and passes it to a worker over the IPC
// channel (SCM_RIGHTS; round-robin, Node's default on Linux); each worker is
// a new node process (fork + exec) that echoes. Prints "PORT n" once every
// worker listens; stops on SIGTERM.
const cluster = require('node:cluster');
const net = require('node:net');
const [addr, workers] = [process.argv[2] || '10.77.0.1', Number(process.argv[3] || 2)];
cluster.schedulingPolicy = cluster.SCHED_RR;
if (cluster.isPrimary) {
  let ready = 0;
  cluster.setupPrimary({ args: [addr, String(workers)] });
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
