#include "util/user_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/sys.h"

namespace rsock::sys {

void* map_user_shm(const char* name, size_t bytes, bool create) {
  int fd = shm_open(name, O_RDWR | (create ? O_CREAT : 0) | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return nullptr;
  struct stat st{};
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_uid == geteuid() && (st.st_mode & 077) == 0 &&
      (st.st_size >= off_t(bytes) || ftruncate(fd, off_t(bytes)) == 0))
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  libc.close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace rsock::sys
