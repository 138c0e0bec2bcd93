// Status<T>: a value or a Linux errno code. Used across every layer below
// preload/, which alone converts it into (-1, errno) for the application.
// No exceptions cross layers; every failure is an errno the kernel could give.
#pragma once

#include <cerrno>
#include <utility>

namespace rsock {

// Tag type so that `return Err(EAGAIN);` converts into any Status<T>.
struct Err {
  explicit constexpr Err(int c) : code(c) {}
  int code;
};

template <typename T>
class [[nodiscard]] Status {
 public:
  Status(T value) : value_(std::move(value)), err_(0) {}  // NOLINT: implicit on purpose
  Status(Err e) : value_(), err_(e.code) {}               // NOLINT
  bool ok() const { return err_ == 0; }
  explicit operator bool() const { return ok(); }
  int error() const { return err_; }
  T& value() & { return value_; }
  const T& value() const& { return value_; }
  T&& value() && { return std::move(value_); }
  T& operator*() & { return value_; }
  const T& operator*() const& { return value_; }
  T* operator->() { return &value_; }
  const T* operator->() const { return &value_; }

 private:
  T value_;
  int err_;
};

template <>
class [[nodiscard]] Status<void> {
 public:
  Status() : err_(0) {}
  Status(Err e) : err_(e.code) {}  // NOLINT
  bool ok() const { return err_ == 0; }
  explicit operator bool() const { return ok(); }
  int error() const { return err_; }

 private:
  int err_;
};

inline Status<void> Ok() { return {}; }

}  // namespace rsock
