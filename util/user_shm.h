// A named shared-memory object of this user's, for tables that processes
// unrelated by fork must find (socket/listen_share.h, socket/holders.h).
#pragma once

#include <cstddef>

namespace rsock::sys {

// Maps /dev/shm/NAME (`name` starts with '/'), `bytes` long, read-write,
// creating it zero-filled if absent and `create`. Only an object this user owns and no
// other user may write is taken: another user's would let it steer our
// connections. nullptr if it cannot be had. Never unmapped.
void* map_user_shm(const char* name, size_t bytes, bool create = true);

}  // namespace rsock::sys
