// A plain TCP program (no librsock API) for the LD_PRELOAD stats test: one
// listener on 127.0.0.1, one client connection to it, CLIENT_BYTES sent
// client->server and SERVER_BYTES back, all read; then it writes its pid to
// READY_FILE and sleeps (connections open) until killed.
//   stats_tcp_pair CLIENT_BYTES SERVER_BYTES READY_FILE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static bool send_all(int fd, size_t n) {
  std::vector<char> buf(n, 'x');
  size_t done = 0;
  while (done < n) {
    ssize_t w = write(fd, buf.data() + done, n - done);
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

static bool recv_all(int fd, size_t n) {
  char buf[4096];
  size_t done = 0;
  while (done < n) {
    ssize_t r = read(fd, buf, sizeof buf < n - done ? sizeof buf : n - done);
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s CLIENT_BYTES SERVER_BYTES READY_FILE\n", argv[0]);
    return 1;
  }
  size_t cbytes = strtoul(argv[1], nullptr, 10), sbytes = strtoul(argv[2], nullptr, 10);
  int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 4) != 0 ||
      getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    perror("listen");
    return 2;
  }
  int c = socket(AF_INET, SOCK_STREAM, 0);
  if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    perror("connect");
    return 3;
  }
  int s = accept(l, nullptr, nullptr);
  if (s < 0) {
    perror("accept");
    return 4;
  }
  if (!send_all(c, cbytes) || !recv_all(s, cbytes) || !send_all(s, sbytes) || !recv_all(c, sbytes)) {
    fprintf(stderr, "transfer failed\n");
    return 5;
  }
  std::string tmp = std::string(argv[3]) + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) return 6;
  fprintf(f, "%d\n", getpid());
  fclose(f);
  rename(tmp.c_str(), argv[3]);
  for (;;) pause();
}
