// The 8-property JSON Schema that accel-bench-structured decodes under and
// accel-bench-grammar walks: strings, integer and number bounds, an enum, a
// boolean and a bounded array, every property required.
#ifndef ACCEL_BENCH_RECORD_SCHEMA_H_
#define ACCEL_BENCH_RECORD_SCHEMA_H_

namespace accel::bench {

inline constexpr const char* kRecordSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12},
  "age": {"type": "integer", "minimum": 0, "maximum": 120},
  "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"},
  "score": {"type": "number", "minimum": 0, "maximum": 100},
  "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
  "note": {"type": "string", "maxLength": 24}},
  "required": ["name", "city", "age", "role", "active", "score", "tags", "note"]})";

}  // namespace accel::bench

#endif  // ACCEL_BENCH_RECORD_SCHEMA_H_
