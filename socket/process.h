// Process-wide state of the socket layer: the configuration, loaded once.
//
// init_process() is called from preload/'s constructor and, because other
// libraries' constructors may open sockets before ours runs, lazily from the
// first hook that needs it. Until it has finished nothing is tracked.
#pragma once

#include "config/config.h"

namespace rsock::socket {

// Idempotent and thread-safe; the first caller loads the config file.
void init_process();

// The loaded configuration (defaults before init_process()).
const config::Config& process_config();

// False when the config was invalid: every socket is then left to the
// kernel untouched, as if librsock were not loaded.
bool tracking_enabled();

// Whether this is a vfork child (or a clone that ran no fork handlers): a
// process that shares librsock's memory with the one it describes, its
// parent, which is suspended until the child execs or exits. Such a child
// has its own copy of the fd table, so its close/dup/exec must not touch
// our state (Python's subprocess vforks, then closes every fd and dup2s its
// pipes: without this the parent lost track of every socket). A getpid()
// syscall: only the fd-lifetime and exec hooks ask.
bool in_vfork_child();
// The process librsock's state describes: set at init and in a fork child.
void note_state_owner();

}  // namespace rsock::socket
