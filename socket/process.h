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

}  // namespace rsock::socket
