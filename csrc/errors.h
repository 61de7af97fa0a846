// C++ exceptions of the native core; bindings.cpp turns each kind into its Python type.
#pragma once

#include <stdexcept>
#include <string>

namespace kvc {

enum class ErrKind { Driver, LibraryNotFound, NoDevice, OutOfMemory, Value, State };

struct Error : std::runtime_error {
  ErrKind kind;
  Error(ErrKind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

[[noreturn]] inline void throw_value(const std::string& msg) { throw Error(ErrKind::Value, msg); }
[[noreturn]] inline void throw_state(const std::string& msg) { throw Error(ErrKind::State, msg); }

// Destructors and background threads report here instead of throwing.
void log_warning(const std::string& msg) noexcept;

}  // namespace kvc
