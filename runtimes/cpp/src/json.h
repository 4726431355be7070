// A small strict JSON reader for manifest.json (untrusted input: bounded depth, exact grammar, clear
// errors). Objects keep their keys in file order; a duplicate key is an error.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hstu_export::json {

class ParseError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };

  Type type = Type::Null;
  bool boolean = false;
  double number = 0;
  std::optional<int64_t> integer;  // set when the number is written as an integer that fits int64
  std::string string;
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;

  bool is_null() const { return type == Type::Null; }
  // The member named key of an object, or nullptr (also when this is not an object).
  const Value* find(std::string_view key) const;
};

// Parses a whole document; throws ParseError naming the byte offset of the first problem.
Value parse(std::string_view text, int max_depth = 64);

std::string type_name(Value::Type type);

}  // namespace hstu_export::json
