// Request ids (issue #15 item 7): drawn from a CSPRNG, so that no number of observed ids
// predicts the next one, and the ids of the calls to the workers are separate draws.
#include "gateway/request_ids.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/testing/status_matchers.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/gateway.h"
#include "gateway/worker_pool.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::testing::MatchesRegex;

// --- The attack of the issue: mt19937_64 state recovery from 312 outputs. ---------------------

uint64_t UndoRightShiftXor(uint64_t y, int shift, uint64_t mask) {
  uint64_t x = y;
  for (int i = 0; i < 64 / shift + 1; ++i) x = y ^ ((x >> shift) & mask);
  return x;
}
uint64_t UndoLeftShiftXor(uint64_t y, int shift, uint64_t mask) {
  uint64_t x = y;
  for (int i = 0; i < 64 / shift + 1; ++i) x = y ^ ((x << shift) & mask);
  return x;
}
// The inverse of mt19937_64's tempering.
uint64_t Untemper(uint64_t y) {
  y = UndoRightShiftXor(y, 43, ~uint64_t{0});
  y = UndoLeftShiftXor(y, 37, 0xFFF7EEE000000000ULL);
  y = UndoLeftShiftXor(y, 17, 0x71D67FFFEDA60000ULL);
  y = UndoRightShiftXor(y, 29, 0x5555555555555555ULL);
  return y;
}
uint64_t Temper(uint64_t y) {
  y ^= (y >> 29) & 0x5555555555555555ULL;
  y ^= (y << 17) & 0x71D67FFFEDA60000ULL;
  y ^= (y << 37) & 0xFFF7EEE000000000ULL;
  y ^= y >> 43;
  return y;
}
// The output that follows 312 consecutive mt19937_64 outputs.
uint64_t PredictNextMt19937_64(const std::vector<uint64_t>& outputs) {
  const size_t n = 312, m = 156;
  std::vector<uint64_t> x;
  for (size_t i = outputs.size() - n; i < outputs.size(); ++i) x.push_back(Untemper(outputs[i]));
  const uint64_t upper = 0xFFFFFFFF80000000ULL, lower = 0x7FFFFFFFULL;
  const uint64_t y = (x[0] & upper) | (x[1] & lower);
  const uint64_t next = x[m] ^ (y >> 1) ^ ((y & 1) ? 0xB5026F5AA96619E9ULL : 0);
  return Temper(next);
}

TEST(RequestIdTest, PredictorBreaksMt19937_64) {
  // The predictor is right about the generator the ids used to come from.
  std::mt19937_64 rng(12345);
  std::vector<uint64_t> out;
  for (int i = 0; i < 400; ++i) out.push_back(rng());
  const uint64_t next = rng();
  EXPECT_EQ(PredictNextMt19937_64(out), next);
}

std::string SourceDir() {
  const char* d = std::getenv("DGSERVE_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

// Issue #15 item 7: after 312 responses the next request id was predicted exactly.
TEST(RequestIdTest, IdsFromPrepareAreNotPredictable) {
  absl::StatusOr<ModelConfig> config =
      LoadModelConfig(SourceDir() + "/tests/testdata/golden/tiny-v512/config.json");
  ASSERT_THAT(config, IsOk());
  absl::StatusOr<Tokenizer> tokenizer =
      Tokenizer::Load(SourceDir() + "/engine/tokenizer/testdata/tiny_v512_tokenizer.json");
  ASSERT_THAT(tokenizer, IsOk());
  GatewayOptions options;
  options.model_id = "m";
  const Gateway gateway(*config, GenerationConfig{}, *tokenizer, options, nullptr, nullptr,
                        nullptr);
  v1::GenerateRequest request;
  request.mutable_token_ids()->add_ids(2);
  request.set_max_tokens(1);

  std::vector<uint64_t> observed;  // the first 64 bits of each id, as an attacker reads them
  std::set<std::string> seen;
  for (int i = 0; i < 313; ++i) {
    absl::StatusOr<PreparedRequest> p = gateway.Prepare(request);
    ASSERT_THAT(p, IsOk());
    EXPECT_THAT(p->request_id, MatchesRegex("[0-9a-f]{32}"));
    EXPECT_TRUE(seen.insert(p->request_id).second) << "repeated id " << p->request_id;
    uint64_t v = 0;
    ASSERT_TRUE(absl::SimpleHexAtoi(p->request_id.substr(0, 16), &v)) << p->request_id;
    observed.push_back(v);
  }
  const uint64_t actual = observed.back();
  observed.pop_back();
  EXPECT_NE(PredictNextMt19937_64(observed), actual);
}

// A prefill and a denoise worker on one loopback server: both answer Stats (healthy), the
// prefill side records the request id of every Prefill and fails it with UNAVAILABLE, so that
// the gateway retries on another prefill worker.
class RecordingPrefill final : public v1::PrefillService::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest* r,
                       v1::PrefillResponse*) override {
    absl::MutexLock lock(&mu);
    ids.push_back(r->request_id());
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "recording worker");
  }
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* out) override {
    out->set_role("prefill");
    out->set_model_id("m");
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::vector<std::string> ids;
};

class IdleDenoise final : public v1::DenoiseService::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* out) override {
    out->set_role("denoise");
    out->set_model_id("m");
    out->set_max_batch_canvases(8);
    return grpc::Status::OK;
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest*,
                      v1::CancelResponse*) override {
    return grpc::Status::OK;
  }
};

struct FakeWorker {
  FakeWorker() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&prefill);
    b.RegisterService(&denoise);
    server = b.BuildAndStart();
  }
  ~FakeWorker() { server->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  RecordingPrefill prefill;
  IdleDenoise denoise;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// The ids the workers see are fresh CSPRNG draws per attempt ("att-" + 128 bits), not the public
// id with an attempt number appended.
TEST(RequestIdTest, AttemptsUseTheirOwnIds) {
  absl::StatusOr<ModelConfig> config =
      LoadModelConfig(SourceDir() + "/tests/testdata/golden/tiny-v512/config.json");
  ASSERT_THAT(config, IsOk());
  absl::StatusOr<Tokenizer> tokenizer =
      Tokenizer::Load(SourceDir() + "/engine/tokenizer/testdata/tiny_v512_tokenizer.json");
  ASSERT_THAT(tokenizer, IsOk());
  FakeWorker a, b;
  ASSERT_GT(a.port, 0);
  ASSERT_GT(b.port, 0);
  WorkerPool prefill("prefill", {a.address(), b.address()}, "m");
  WorkerPool denoise("denoise", {a.address()}, "m");
  prefill.Start();
  denoise.Start();
  ASSERT_EQ(prefill.healthy_count(), 2);
  ASSERT_EQ(denoise.healthy_count(), 1);
  GatewayOptions options;
  options.model_id = "m";
  options.max_attempts = 2;
  Gateway gateway(*config, GenerationConfig{}, *tokenizer, options, &prefill, &denoise, nullptr);
  v1::GenerateRequest request;
  request.mutable_token_ids()->add_ids(2);
  request.set_max_tokens(1);
  const absl::Status s = gateway.Generate(
      request, absl::Now() + absl::Seconds(30), [] { return false; },
      [](const v1::GenerateEvent&) { return true; });
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  // Every attempt's picks were counted and released (WorkerHold), failed prefills included.
  EXPECT_EQ(prefill.inflight(a.address()), 0);
  EXPECT_EQ(prefill.inflight(b.address()), 0);
  EXPECT_EQ(denoise.inflight(a.address()), 0);
  std::vector<std::string> ids;
  for (FakeWorker* w : {&a, &b}) {
    absl::MutexLock lock(&w->prefill.mu);
    ids.insert(ids.end(), w->prefill.ids.begin(), w->prefill.ids.end());
  }
  ASSERT_EQ(ids.size(), 2u);  // one attempt on each prefill worker
  for (const std::string& id : ids) EXPECT_THAT(id, MatchesRegex("att-[0-9a-f]{32}"));
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[0].substr(4, 16), ids[1].substr(4, 16));  // not one id with a counter
}

TEST(RequestIdTest, InternalIdsAreSeparateDraws) {
  absl::StatusOr<std::string> a = NewRequestId();
  absl::StatusOr<std::string> b = NewInternalId();
  absl::StatusOr<std::string> c = NewInternalId();
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT(*b, MatchesRegex("att-[0-9a-f]{32}"));
  EXPECT_NE(*b, *c);
  EXPECT_EQ(b->find(*a), std::string::npos);
}

TEST(RequestIdTest, SeedsCoverTheRange) {
  // 64 draws of 63 random bits: every bit position but the top one is set at least once
  // (probability of failure 63 · 2^-64).
  uint64_t any = 0;
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<uint64_t> s = NewRandomSeed();
    ASSERT_THAT(s, IsOk());
    EXPECT_LT(*s, uint64_t{1} << 63);
    any |= *s;
  }
  EXPECT_EQ(any, (uint64_t{1} << 63) - 1);
}

}  // namespace
}  // namespace dgserve
