// grammar/json_schema.h: JSON Schema to grammar, for response_format
// json_schema, guided_json and tool arguments.
//
// Supported: type (and lists of types), properties, required,
// additionalProperties (false, true or a schema; absent counts as false, as
// OpenAI's strict mode and xgrammar read it: the output has only the listed
// properties), enum, const, items, prefixItems (items after them only where
// `items` allows), minItems / maxItems, anyOf / oneOf (oneOf as anyOf: a
// grammar cannot check that only one branch matches), allOf of one schema,
// $ref to "#", "#/$defs/..." or "#/definitions/..." (recursion allowed),
// string minLength / maxLength / pattern / format (date, time, date-time,
// uuid, email, ipv4), integer minimum / maximum / exclusiveMinimum /
// exclusiveMaximum, number minimum / maximum when they are integers >= 0.
// Annotations ($schema, $id, title, description, default, examples,
// $comment, deprecated, readOnly, writeOnly) are accepted and ignored. Any
// other keyword, or a supported one with a value it cannot honour, is
// InvalidArgument naming the keyword and where it is ("json_schema: keyword
// 'uniqueItems' at /properties/tags is not supported"): never dropped.
//
// Output layout: properties in the schema's order, at most one space or a
// newline and 20 spaces or tabs between tokens, numbers with at most 16
// digits before and after the point (a random model cannot run one on
// forever).
#ifndef ACCEL_GRAMMAR_JSON_SCHEMA_H_
#define ACCEL_GRAMMAR_JSON_SCHEMA_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "grammar/grammar.h"

namespace accel::grammar {

// The GBNF of a schema given as JSON text.
absl::StatusOr<std::string> JsonSchemaToGbnf(absl::string_view schema_json);
// Compiled, through a process-wide cache keyed by the schema's canonical
// text (a repeated schema costs a lookup).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(absl::string_view schema_json);
// Any JSON object (response_format {"type": "json_object"}).
std::shared_ptr<const Grammar> JsonObjectGrammar();
// Any JSON value.
std::shared_ptr<const Grammar> JsonValueGrammar();

}  // namespace accel::grammar

#endif  // ACCEL_GRAMMAR_JSON_SCHEMA_H_
