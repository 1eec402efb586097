// engine/output_processor.h: what a step sampled, turned into what clients
// read (vLLM v1's OutputProcessor and detokenizer): each token's text from
// the request's incremental decoder, stop strings (the text is cut before
// one, and text that could be the start of one is held back while
// streaming, so a stop string never reaches a client), log-probabilities,
// and finish reasons.
//
// Torch-free and not thread-safe: the engine core's thread owns it.
#ifndef ACCEL_ENGINE_OUTPUT_PROCESSOR_H_
#define ACCEL_ENGINE_OUTPUT_PROCESSOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"

namespace accel::tokenizer {
class Tokenizer;
}  // namespace accel::tokenizer

namespace accel::engine {

// Turns one sequence's generated ids into text as they arrive: every piece
// is valid UTF-8 and the pieces plus Flush() are the decoded text (a
// tokenizer's incremental decoder). An id the tokenizer lacks (models often
// pad their vocabulary past the tokenizer's) decodes to nothing, as
// HuggingFace's decode skips it.
class TextStream {
 public:
  virtual ~TextStream() = default;
  virtual std::string Next(int64_t id) = 0;
  virtual std::string Flush() = 0;
};
using TextStreamFactory = std::function<std::unique_ptr<TextStream>()>;

// Text streams from the tokenizer's incremental decoder, skipping special
// tokens (so an eos reads as nothing). The factory keeps its own copy of
// the tokenizer (a shared, immutable table).
TextStreamFactory TokenizerTextStreams(const tokenizer::Tokenizer& tokenizer);

class OutputProcessor {
 public:
  // Without `text_streams`, events carry no text (and requests cannot have
  // stop strings: the input processor refuses them).
  explicit OutputProcessor(TextStreamFactory text_streams);
  ~OutputProcessor();

  bool has_text_streams() const { return static_cast<bool>(text_streams_); }

  void Add(uint64_t id, const GenerationRequest& request);
  void Remove(uint64_t id);

  // One event per token of each update, in order. A stop string in the text
  // ends its request there (finish kStop; the tokens after it are dropped);
  // a finish the scheduler set (eos, length) flushes the decoder first, and
  // the flushed text can still complete a stop string. Requests that
  // finished are removed.
  std::vector<TokenEvent> Process(std::vector<RequestUpdate> updates);

 private:
  struct Detokenizer;
  TextStreamFactory text_streams_;
  std::map<uint64_t, std::unique_ptr<Detokenizer>> requests_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_OUTPUT_PROCESSOR_H_
