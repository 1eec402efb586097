// The KServe v2 service against the real accel-serve binary: what a Triton
// or KServe client sees, checked against accel.v1.Generation for the same
// prompts.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "accel/v1/generation.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/server/server_process.h"

namespace accel {
namespace {

using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class KServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto started = testing::ServerProcess::Start(testing::TestModelDir(), {});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    // What the server said helps when it is the server that failed.
    if (server_ != nullptr && ::testing::UnitTest::GetInstance()->failed_test_count() > 0) {
      std::fprintf(stderr, "accel-serve's stderr:\n%s\n", server_->Stderr().c_str());
    }
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = GRPCInferenceService::NewStub(server_->Channel());
    generation_ = accel::v1::Generation::NewStub(server_->Channel());
  }

  static void SetDeadline(grpc::ClientContext& context) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  std::string ModelName() {
    grpc::ClientContext context;
    SetDeadline(context);
    accel::v1::ModelInfo info;
    grpc::Status status = generation_->GetModelInfo(&context, {}, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.name();
  }

  grpc::Status Infer(const ModelInferRequest& request, ModelInferResponse* response) {
    grpc::ClientContext context;
    SetDeadline(context);
    return stub_->ModelInfer(&context, request, response);
  }

  // accel.v1's answer for a prompt (text, or ids when `ids` is non-empty).
  accel::v1::GenerateResponse Generate(const std::string& prompt, const std::vector<int64_t>& ids,
                                       int64_t max_new_tokens, double temperature = 0,
                                       std::optional<uint64_t> seed = std::nullopt) {
    accel::v1::GenerateRequest request;
    if (ids.empty()) {
      request.set_prompt(prompt);
    } else {
      for (int64_t id : ids) request.mutable_input_ids()->add_ids(id);
    }
    request.set_max_new_tokens(max_new_tokens);
    request.mutable_sampling()->set_temperature(temperature);
    if (seed) request.mutable_sampling()->set_seed(*seed);
    grpc::ClientContext context;
    SetDeadline(context);
    accel::v1::GenerateResponse response;
    grpc::Status status = generation_->Generate(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  static testing::ServerProcess* server_;
  std::unique_ptr<GRPCInferenceService::Stub> stub_;
  std::unique_ptr<accel::v1::Generation::Stub> generation_;
};

testing::ServerProcess* KServeTest::server_ = nullptr;

ModelInferRequest::InferInputTensor* AddInput(ModelInferRequest& request, const std::string& name,
                                              const std::string& datatype,
                                              std::vector<int64_t> shape) {
  auto* t = request.add_inputs();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int64_t d : shape) t->add_shape(d);
  return t;
}

ModelInferRequest TextRequest(const std::vector<std::string>& prompts, int64_t max_tokens) {
  ModelInferRequest request;
  auto* t = AddInput(request, "text_input", "BYTES", {static_cast<int64_t>(prompts.size())});
  for (const std::string& p : prompts) t->mutable_contents()->add_bytes_contents(p);
  (*request.mutable_parameters())["max_tokens"].set_int64_param(max_tokens);
  return request;
}

const inference::ModelInferResponse::InferOutputTensor* FindOutput(
    const ModelInferResponse& response, const std::string& name, int* index = nullptr) {
  for (int i = 0; i < response.outputs_size(); ++i) {
    if (response.outputs(i).name() == name) {
      if (index != nullptr) *index = i;
      return &response.outputs(i);
    }
  }
  return nullptr;
}

std::vector<std::string> Texts(const ModelInferResponse& response,
                               const std::string& name = "text_output") {
  const auto* out = FindOutput(response, name);
  if (out == nullptr) return {};
  return {out->contents().bytes_contents().begin(), out->contents().bytes_contents().end()};
}

bool FinalFlag(const ModelInferResponse& response) {
  auto it = response.parameters().find("triton_final_response");
  return it != response.parameters().end() && it->second.bool_param();
}

// --- Health and metadata.

TEST_F(KServeTest, LiveAndReady) {
  grpc::ClientContext live_context;
  inference::ServerLiveResponse live;
  ASSERT_TRUE(stub_->ServerLive(&live_context, {}, &live).ok());
  EXPECT_TRUE(live.live());
  grpc::ClientContext ready_context;
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(stub_->ServerReady(&ready_context, {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
}

TEST_F(KServeTest, ModelReadyKnowsTheServedName) {
  const std::string name = ModelName();
  for (const std::string version : {"", "1"}) {
    grpc::ClientContext context;
    inference::ModelReadyRequest request;
    request.set_name(name);
    request.set_version(version);
    inference::ModelReadyResponse response;
    ASSERT_TRUE(stub_->ModelReady(&context, request, &response).ok());
    EXPECT_TRUE(response.ready());
  }
  grpc::ClientContext wrong_context;
  inference::ModelReadyRequest wrong;
  wrong.set_name("gpt-17");
  inference::ModelReadyResponse response;
  grpc::Status status = stub_->ModelReady(&wrong_context, wrong, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("gpt-17"));
  EXPECT_THAT(status.error_message(), HasSubstr(name));
  grpc::ClientContext version_context;
  inference::ModelReadyRequest version;
  version.set_name(name);
  version.set_version("2");
  status = stub_->ModelReady(&version_context, version, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KServeTest, ServerMetadata) {
  grpc::ClientContext context;
  inference::ServerMetadataResponse response;
  ASSERT_TRUE(stub_->ServerMetadata(&context, {}, &response).ok());
  EXPECT_EQ(response.name(), "accel");
  EXPECT_FALSE(response.version().empty());
  EXPECT_THAT(response.extensions(), ElementsAre("parameters"));
}

TEST_F(KServeTest, ModelMetadata) {
  const std::string name = ModelName();
  grpc::ClientContext context;
  inference::ModelMetadataRequest request;
  request.set_name(name);
  inference::ModelMetadataResponse response;
  ASSERT_TRUE(stub_->ModelMetadata(&context, request, &response).ok());
  EXPECT_EQ(response.name(), name);
  EXPECT_THAT(response.versions(), ElementsAre("1"));
  EXPECT_EQ(response.platform(), "accel_libtorch");
  std::vector<std::string> inputs, outputs;
  for (const auto& t : response.inputs()) inputs.push_back(t.name() + ":" + t.datatype());
  for (const auto& t : response.outputs()) outputs.push_back(t.name() + ":" + t.datatype());
  EXPECT_THAT(inputs, ::testing::IsSupersetOf({"text_input:BYTES", "input_ids:INT64"}));
  EXPECT_THAT(outputs, ::testing::IsSupersetOf({"text_output:BYTES", "output_ids:INT64",
                                                "finish_reason:BYTES", "num_input_tokens:UINT32",
                                                "num_output_tokens:UINT32"}));
  EXPECT_EQ(response.properties().at("architecture"), "LlamaForCausalLM");
  EXPECT_EQ(response.properties().at("max_context"), "256");
  EXPECT_NE(response.properties().at("parameters"), "0");

  grpc::ClientContext wrong_context;
  request.set_name("nope");
  EXPECT_EQ(stub_->ModelMetadata(&wrong_context, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// --- ModelInfer.

TEST_F(KServeTest, TypedTextMatchesGenerate) {
  ModelInferRequest request = TextRequest({"The quick brown fox"}, 8);
  request.set_model_name(ModelName());
  request.set_id("req-1");
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.model_name(), ModelName());
  EXPECT_EQ(response.model_version(), "1");
  EXPECT_EQ(response.id(), "req-1");
  EXPECT_EQ(response.raw_output_contents_size(), 0);
  const accel::v1::GenerateResponse expected = Generate("The quick brown fox", {}, 8);
  EXPECT_THAT(Texts(response), ElementsAre(expected.text()));
  EXPECT_THAT(Texts(response, "finish_reason"), ElementsAre("length"));
  const auto* generated = FindOutput(response, "num_output_tokens");
  ASSERT_NE(generated, nullptr);
  EXPECT_EQ(generated->datatype(), "UINT32");
  EXPECT_THAT(generated->contents().uint_contents(), ElementsAre(8));
  const auto* prompt = FindOutput(response, "num_input_tokens");
  ASSERT_NE(prompt, nullptr);
  EXPECT_THAT(prompt->contents().uint_contents(),
              ElementsAre(static_cast<uint32_t>(expected.usage().prompt_tokens())));
  EXPECT_EQ(FindOutput(response, "output_ids"), nullptr);  // text in, text out
}

TEST_F(KServeTest, RawTextIsAnsweredRaw) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {1});
  const std::string prompt = "The quick brown fox";
  std::string raw(4, '\0');
  raw[0] = static_cast<char>(prompt.size());
  request.add_raw_input_contents(raw + prompt);
  (*request.mutable_parameters())["max_tokens"].set_int64_param(8);
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  int index = -1;
  ASSERT_NE(FindOutput(response, "text_output", &index), nullptr);
  ASSERT_EQ(response.raw_output_contents_size(), response.outputs_size());
  const std::string& bytes = response.raw_output_contents(index);
  ASSERT_GE(bytes.size(), 4u);
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i)
    length |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  ASSERT_EQ(bytes.size(), 4 + length);
  EXPECT_EQ(bytes.substr(4), Generate(prompt, {}, 8).text());
}

TEST_F(KServeTest, InputIdsMatchGenerate) {
  const std::vector<int64_t> ids = {1, 15, 27, 33, 8};
  const accel::v1::GenerateResponse expected = Generate("", ids, 6);
  ASSERT_EQ(expected.token_ids_size(), 6);
  for (int rank : {1, 2}) {
    ModelInferRequest request;
    std::vector<int64_t> shape = {static_cast<int64_t>(ids.size())};
    if (rank == 2) shape.insert(shape.begin(), 1);
    auto* t = AddInput(request, "input_ids", "INT64", shape);
    for (int64_t id : ids) t->mutable_contents()->add_int64_contents(id);
    (*request.mutable_parameters())["max_tokens"].set_int64_param(6);
    ModelInferResponse response;
    grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const auto* out = FindOutput(response, "output_ids");
    ASSERT_NE(out, nullptr);
    EXPECT_EQ(out->datatype(), "INT64");
    if (rank == 1) {
      EXPECT_THAT(out->shape(), ElementsAre(6));
    } else {
      EXPECT_THAT(out->shape(), ElementsAre(1, 6));
    }
    EXPECT_THAT(out->contents().int64_contents(),
                ElementsAre(expected.token_ids(0), expected.token_ids(1), expected.token_ids(2),
                            expected.token_ids(3), expected.token_ids(4), expected.token_ids(5)));
  }
}

TEST_F(KServeTest, Int32RawIdsMatchGenerate) {
  const std::vector<int64_t> ids = {1, 15, 27};
  const accel::v1::GenerateResponse expected = Generate("", ids, 4);
  ModelInferRequest request;
  AddInput(request, "input_ids", "INT32", {1, 3});
  std::string raw;
  for (int64_t id : ids) {
    const auto v = static_cast<uint32_t>(id);
    for (int i = 0; i < 4; ++i) raw.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  request.add_raw_input_contents(raw);
  AddInput(request, "max_tokens", "INT32", {1});
  request.add_raw_input_contents(std::string("\x04\x00\x00\x00", 4));
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  int index = -1;
  ASSERT_NE(FindOutput(response, "output_ids", &index), nullptr);
  const std::string& bytes = response.raw_output_contents(index);
  ASSERT_EQ(bytes.size(), 4u * 8);
  for (int j = 0; j < 4; ++j) {
    int64_t id;
    std::memcpy(&id, bytes.data() + 8 * j, 8);  // the build machines are little-endian
    EXPECT_EQ(id, expected.token_ids(j)) << j;
  }
}

TEST_F(KServeTest, ParametersAndSamplingJsonAgree) {
  const std::string prompt = "Once upon a time";
  const accel::v1::GenerateResponse expected = Generate(prompt, {}, 10, 0.9, 1234);

  ModelInferRequest with_parameters = TextRequest({prompt}, 10);
  (*with_parameters.mutable_parameters())["temperature"].set_double_param(0.9);
  (*with_parameters.mutable_parameters())["seed"].set_uint64_param(1234);
  ModelInferResponse a;
  grpc::Status status = Infer(with_parameters, &a);
  ASSERT_TRUE(status.ok()) << status.error_message();

  ModelInferRequest with_json;
  AddInput(with_json, "text_input", "BYTES", {1})->mutable_contents()->add_bytes_contents(prompt);
  AddInput(with_json, "sampling_parameters", "BYTES", {1})
      ->mutable_contents()
      ->add_bytes_contents(R"({"temperature": "0.9", "seed": 1234, "max_tokens": 10})");
  ModelInferResponse b;
  status = Infer(with_json, &b);
  ASSERT_TRUE(status.ok()) << status.error_message();

  EXPECT_THAT(Texts(a), ElementsAre(expected.text()));
  EXPECT_THAT(Texts(b), ElementsAre(expected.text()));
}

TEST_F(KServeTest, ThreePromptsInOneRequest) {
  const std::vector<std::string> prompts = {"Hello", "The weather today", "1, 2, 3,"};
  ModelInferResponse response;
  grpc::Status status = Infer(TextRequest(prompts, 5), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const auto* text = FindOutput(response, "text_output");
  ASSERT_NE(text, nullptr);
  EXPECT_THAT(text->shape(), ElementsAre(3));
  std::vector<std::string> expected;
  for (const std::string& p : prompts) expected.push_back(Generate(p, {}, 5).text());
  EXPECT_EQ(Texts(response), expected);
  EXPECT_THAT(Texts(response, "finish_reason"), ElementsAre("length", "length", "length"));
}

TEST_F(KServeTest, ErrorsNameTheProblem) {
  ModelInferResponse response;
  ModelInferRequest unknown_model = TextRequest({"hi"}, 2);
  unknown_model.set_model_name("gpt-17");
  grpc::Status status = Infer(unknown_model, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("gpt-17"));

  status = Infer(TextRequest({""}, 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("text_input"));

  status = Infer(TextRequest({"ok", ""}, 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("text_input[1]"));

  ModelInferRequest cold = TextRequest({"hi"}, 2);
  (*cold.mutable_parameters())["temperature"].set_double_param(-1);
  status = Infer(cold, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("temperature"));

  ModelInferRequest typo = TextRequest({"hi"}, 2);
  (*typo.mutable_parameters())["temprature"].set_double_param(0.5);
  status = Infer(typo, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("temprature"));

  ModelInferRequest stream = TextRequest({"hi"}, 2);
  AddInput(stream, "stream", "BOOL", {1})->mutable_contents()->add_bool_contents(true);
  status = Infer(stream, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("ModelStreamInfer"));
}

TEST_F(KServeTest, DeadlineEndsTheCall) {
  // 240 tokens take well over 30 ms (about 1 ms a step on a CPU).
  ModelInferRequest request = TextRequest({"a long story"}, 240);
  (*request.mutable_parameters())["ignore_eos"].set_bool_param(true);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(30));
  ModelInferResponse response;
  grpc::Status status = stub_->ModelInfer(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server is still fine afterwards.
  status = Infer(TextRequest({"hi"}, 2), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// --- ModelStreamInfer.

struct StreamResult {
  std::string text;
  int finals = 0;
  int messages = 0;
  bool final_was_last = true;
  std::vector<std::string> errors;
  std::string finish_reason;
};

TEST_F(KServeTest, StreamConcatenatesToTheUnaryText) {
  const std::string prompt = "The quick brown fox";
  ModelInferResponse unary;
  // Enough tokens that a stream cannot plausibly be merged into one message
  // (the write pump merges what arrives while a write is in flight).
  ASSERT_TRUE(Infer(TextRequest({prompt}, 48), &unary).ok());
  ASSERT_FALSE(Texts(unary).at(0).empty());  // else the comparison below proves little

  grpc::ClientContext context;
  SetDeadline(context);
  auto stream = stub_->ModelStreamInfer(&context);
  // Two generations at once, told apart by id, and a bad request between
  // them that must not close the stream.
  for (const char* id : {"a", "bad", "b"}) {
    ModelInferRequest request = TextRequest({std::string(id) == "bad" ? "" : prompt}, 48);
    request.set_id(id);
    AddInput(request, "stream", "BOOL", {1})->mutable_contents()->add_bool_contents(true);
    ASSERT_TRUE(stream->Write(request));
  }
  ASSERT_TRUE(stream->WritesDone());
  std::map<std::string, StreamResult> results;
  inference::ModelStreamInferResponse message;
  while (stream->Read(&message)) {
    StreamResult& r = results[message.infer_response().id()];
    if (!message.error_message().empty()) {
      r.errors.push_back(message.error_message());
      continue;
    }
    if (r.finals > 0) r.final_was_last = false;
    ++r.messages;
    for (const std::string& t : Texts(message.infer_response())) r.text += t;
    if (FinalFlag(message.infer_response())) {
      ++r.finals;
      const std::vector<std::string> reasons = Texts(message.infer_response(), "finish_reason");
      if (!reasons.empty()) r.finish_reason = reasons[0];
    }
  }
  grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (const char* id : {"a", "b"}) {
    const StreamResult& r = results[id];
    EXPECT_EQ(r.text, Texts(unary)[0]) << id;
    EXPECT_EQ(r.finals, 1) << id;
    EXPECT_GE(r.messages, 2) << id;  // streamed, not one answer at the end
    EXPECT_TRUE(r.final_was_last) << id;
    EXPECT_EQ(r.finish_reason, "length") << id;
    EXPECT_TRUE(r.errors.empty()) << id;
  }
  ASSERT_EQ(results["bad"].errors.size(), 1u);
  EXPECT_THAT(results["bad"].errors[0], HasSubstr("INVALID_ARGUMENT"));
}

TEST_F(KServeTest, StreamWithoutStreamFlagAnswersOnce) {
  const std::string prompt = "Hello there";
  ModelInferResponse unary;
  ASSERT_TRUE(Infer(TextRequest({prompt}, 6), &unary).ok());
  grpc::ClientContext context;
  SetDeadline(context);
  auto stream = stub_->ModelStreamInfer(&context);
  ASSERT_TRUE(stream->Write(TextRequest({prompt}, 6)));
  ASSERT_TRUE(stream->WritesDone());
  std::vector<inference::ModelStreamInferResponse> messages;
  inference::ModelStreamInferResponse message;
  while (stream->Read(&message)) messages.push_back(message);
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_TRUE(FinalFlag(messages[0].infer_response()));
  EXPECT_EQ(Texts(messages[0].infer_response()), Texts(unary));
}

TEST_F(KServeTest, StreamCancelStopsTheGenerations) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto stream = stub_->ModelStreamInfer(&context);
  ModelInferRequest request = TextRequest({"a long story"}, 200);
  (*request.mutable_parameters())["ignore_eos"].set_bool_param(true);
  (*request.mutable_parameters())["stream"].set_bool_param(true);
  ASSERT_TRUE(stream->Write(request));
  inference::ModelStreamInferResponse message;
  ASSERT_TRUE(stream->Read(&message));  // it started
  context.TryCancel();
  while (stream->Read(&message)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Nothing is left running: a new request is answered at once.
  ModelInferResponse response;
  grpc::Status status = Infer(TextRequest({"hi"}, 2), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

}  // namespace
}  // namespace accel
