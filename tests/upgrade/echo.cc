// rsock_echo: a plain TCP echo server and checksumming client, used to test
// fallback in every combination of preloaded and plain ends.
//   rsock_echo server PORT            echoes every connection until EOF (forks one child per test)
//   rsock_echo client ADDR PORT BYTES sends BYTES of a pattern, reads them back, verifies
// Exit status 0 on success; the client prints "ok BYTES".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

unsigned char pattern(size_t i) { return static_cast<unsigned char>((i * 2654435761u) >> 13); }

int serve(int port) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) || listen(l, 64)) {
    perror("rsock_echo: bind/listen");
    return 1;
  }
  printf("listening %d\n", port);
  fflush(stdout);
  for (;;) {
    int c = accept(l, nullptr, nullptr);
    if (c < 0) continue;
    std::thread([c] {
      std::vector<char> buf(256 * 1024);
      for (;;) {
        ssize_t n = read(c, buf.data(), buf.size());
        if (n <= 0) break;
        for (ssize_t off = 0; off < n;) {
          ssize_t w = write(c, buf.data() + off, size_t(n - off));
          if (w <= 0) {
            close(c);
            return;
          }
          off += w;
        }
      }
      close(c);
    }).detach();
  }
}

int client(const char* addr, int port, size_t bytes) {
  int c = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, addr, &a.sin_addr);
  if (connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a)) {
    perror("rsock_echo: connect");
    return 1;
  }
  std::thread writer([&] {
    std::vector<unsigned char> buf(100 * 1000);
    for (size_t off = 0; off < bytes;) {
      size_t n = std::min(buf.size(), bytes - off);
      n = 1 + size_t(rand()) % n;  // odd sizes: the switch falls anywhere
      for (size_t i = 0; i < n; i++) buf[i] = pattern(off + i);
      ssize_t w = write(c, buf.data(), n);
      if (w <= 0) {
        perror("rsock_echo: write");
        exit(1);
      }
      off += size_t(w);
    }
    shutdown(c, SHUT_WR);
  });
  std::vector<unsigned char> buf(256 * 1024);
  size_t got = 0;
  for (;;) {
    ssize_t n = read(c, buf.data(), buf.size());
    if (n < 0) {
      perror("rsock_echo: read");
      return 1;
    }
    if (n == 0) break;
    for (ssize_t i = 0; i < n; i++) {
      if (buf[size_t(i)] != pattern(got + size_t(i))) {
        fprintf(stderr, "rsock_echo: wrong byte at offset %zu\n", got + size_t(i));
        return 1;
      }
    }
    got += size_t(n);
  }
  writer.join();
  close(c);
  if (got != bytes) {
    fprintf(stderr, "rsock_echo: got %zu of %zu bytes back\n", got, bytes);
    return 1;
  }
  printf("ok %zu\n", got);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && !strcmp(argv[1], "server")) return serve(atoi(argv[2]));
  if (argc == 5 && !strcmp(argv[1], "client"))
    return client(argv[2], atoi(argv[3]), strtoull(argv[4], nullptr, 10));
  fprintf(stderr, "usage: rsock_echo server PORT | client ADDR PORT BYTES\n");
  return 2;
}
