// server/internal/quote.h: core/quote.h's Quote under the name the server's
// adapters use.
#ifndef ACCEL_SERVER_INTERNAL_QUOTE_H_
#define ACCEL_SERVER_INTERNAL_QUOTE_H_

#include "core/quote.h"

namespace accel::server::internal {

using ::accel::kMaxQuotedBytes;
using ::accel::Quote;

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_QUOTE_H_
