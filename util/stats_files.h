// Segment files on disk: naming, validation, liveness. Shared by the writer
// (util/stats.cc) and the reader (util/stats_reader.cc, rsock-stat).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "util/stats_layout.h"
#include "util/status.h"

namespace rsock::stats::files {

std::string uid_dir(std::string_view root, uid_t uid);
std::string segment_path(std::string_view uid_dir, int pid, uint32_t index);

// "<pid>" -> index 0, "<pid>.<k>" -> index k. False for anything else.
bool parse_name(std::string_view name, int* pid, uint32_t* index);

// Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid it
// identifies one process for good, even after the pid is reused.
Status<uint64_t> process_start_time(int pid);
bool pid_alive(int pid);

enum class Check { kOk, kNotReady, kBad };
// Validates the header at `data` (file_size bytes mapped/read). kNotReady:
// magic still 0 (writer is creating it). kBad: *why says what is wrong, in
// words fit for the user ("layout version 7, this rsock-stat reads 1").
Check check_header(const void* data, size_t file_size, int expect_pid, uint32_t expect_index,
                   std::string* why);

// Removes files in `dir` whose process is gone or whose pid was reused (start
// time differs). Files of `keep_pid` are left alone. Returns how many went.
size_t remove_stale(const std::string& dir, int keep_pid);

// Small file reads through the real libc (safe inside librsock.so).
Status<size_t> read_small(const char* path, char* buf, size_t cap);

}  // namespace rsock::stats::files
