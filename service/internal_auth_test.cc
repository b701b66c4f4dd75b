#include "service/internal_auth.h"

#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/testing/temp_dir.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "service/auth_testing.h"
#include "service/server.h"

namespace dgserve {
namespace {

using testing::GarbageMessage;
using testing::RawUnaryCall;

constexpr char kStats[] = "/dgserve.v1.DenoiseService/Stats";
constexpr char kHealth[] = "/grpc.health.v1.Health/Check";

// Counts the calls that reach a handler.
class CountingDenoise final : public v1::DenoiseService::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* response) override {
    ++calls;
    response->set_role("denoise");
    return grpc::Status::OK;
  }
  std::atomic<int> calls{0};
};

std::string TempDir() {
  const std::string d = ::dgserve::testing::MakeTempDirRemovedAtExit("dgserve_auth");
  EXPECT_NE(d, "");
  return d.empty() ? "/tmp" : d;
}

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// tools/make_internal_certs.sh into `dir` (`force`: new CA and certificates).
void MakeCerts(const std::string& dir, bool force = false) {
  const char* src = getenv("DGSERVE_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  const std::string cmd = absl::StrCat(src, "/tools/make_internal_certs.sh ",
                                       force ? "--force " : "", dir, " >/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

InternalAuthOptions Tls(const std::string& dir) {
  InternalAuthOptions o;
  o.tls_cert = dir + "/tls.crt";
  o.tls_key = dir + "/tls.key";
  o.tls_ca = dir + "/ca.crt";
  return o;
}

// A server with the counting service (and the health service) on 127.0.0.1 with `creds`.
struct TestServer {
  explicit TestServer(std::shared_ptr<grpc::ServerCredentials> creds) {
    ServerOptions o;
    o.metrics_address = "";
    o.credentials = std::move(creds);
    runner = std::make_unique<ServiceRunner>(o);
    EXPECT_TRUE(runner->Start({&service}, {v1::DenoiseService::service_full_name()}).ok());
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", runner->grpc_port()); }
  CountingDenoise service;
  std::unique_ptr<ServiceRunner> runner;
};

grpc::Status CallStats(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatsResponse resp;
  return v1::DenoiseService::NewStub(channel)->Stats(&ctx, v1::StatsRequest(), &resp);
}

TEST(InternalAuthTest, RefusesToStartWithoutCredentialsOrExplicitPlaintext) {
  absl::StatusOr<std::shared_ptr<const InternalAuth>> a = InternalAuth::Create({});
  ASSERT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* flag : {"--internal_tls_cert", "--internal_token_file", "--internal_insecure"}) {
    EXPECT_NE(a.status().message().find(flag), std::string::npos) << flag;
  }
  InternalAuthOptions o;
  o.insecure = true;
  a = InternalAuth::Create(o);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->Describe(), "plaintext, unauthenticated");
  o.token_file = "/nonexistent";
  EXPECT_EQ(InternalAuth::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  InternalAuthOptions partial;
  partial.tls_cert = "/x.crt";
  EXPECT_EQ(InternalAuth::Create(partial).status().code(), absl::StatusCode::kInvalidArgument);
  InternalAuthOptions missing;
  missing.token_file = "/nonexistent/token";
  EXPECT_EQ(InternalAuth::Create(missing).status().code(), absl::StatusCode::kNotFound);
  InternalAuthOptions short_token;
  short_token.token_file = WriteFile(TempDir(), "token", "abc\n");
  EXPECT_EQ(InternalAuth::Create(short_token).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(InternalAuthTest, ConstantTimeEqualsAndBearer) {
  EXPECT_TRUE(ConstantTimeEquals("abcdef", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcdef", "abcdeg"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  std::multimap<grpc::string_ref, grpc::string_ref> md;
  EXPECT_EQ(BearerToken(md), "");
  md.emplace("authorization", "bEaReR xyz");
  EXPECT_EQ(BearerToken(md), "xyz");
}

TEST(InternalAuthTest, TokenIsCheckedBeforeTheMessageIsReadAndTheHandlerNeverRuns) {
  const std::string dir = TempDir();
  const std::string token = "0123456789abcdef0123456789abcdef";
  InternalAuthOptions o;
  o.token_file = WriteFile(dir, "token", token + "\n");
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuth::Create(o);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->Describe(), "token (plaintext)");
  TestServer server((*auth)->ServerCredentials());
  auto plain = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());

  // No token, a wrong token, the right token in the wrong scheme.
  grpc::Status s = CallStats(plain);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  for (const std::string& header : {absl::StrCat("Bearer ", token, "x"), std::string("Bearer "),
                                    absl::StrCat("Basic ", token)}) {
    s = RawUnaryCall(plain, kStats, "", {{"authorization", header}});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << header;
  }
  // A 16 MB body that is no message at all: refused on its headers, never parsed (with the
  // token the same body reaches the parser and fails there, INVALID_ARGUMENT, without reaching
  // the handler).
  s = RawUnaryCall(plain, kStats, GarbageMessage(16 << 20));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  s = RawUnaryCall(plain, kStats, GarbageMessage(1024), {{"authorization", "Bearer " + token}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(server.service.calls.load(), 0);

  // The health service stays open (probes), reflection does not.
  EXPECT_TRUE(RawUnaryCall(plain, kHealth, "").ok());
  EXPECT_EQ(RawUnaryCall(plain, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                         "")
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // The internal channel carries the token.
  s = CallStats((*auth)->MakeChannel(server.address()));
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(server.service.calls.load(), 1);
}

TEST(InternalAuthTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  const std::string dir = TempDir();
  MakeCerts(dir);
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuth::Create(Tls(dir));
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->Describe(), "mutual TLS");
  TestServer server((*auth)->ServerCredentials());

  grpc::Status s = CallStats((*auth)->MakeChannel(server.address()));
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(server.service.calls.load(), 1);

  // Plaintext, and TLS without a client certificate: the handshake fails.
  s = CallStats(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  EXPECT_FALSE(s.ok());
  grpc::SslCredentialsOptions no_client_cert;
  {
    std::ifstream in(dir + "/ca.crt");
    no_client_cert.pem_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  }
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  s = CallStats(grpc::CreateCustomChannel(server.address(),
                                          grpc::SslCredentials(no_client_cert), args));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // A certificate from another CA.
  const std::string other = TempDir();
  MakeCerts(other);
  auto foreign = InternalAuth::Create(Tls(other));
  ASSERT_TRUE(foreign.ok());
  s = CallStats((*foreign)->MakeChannel(server.address()));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // Health included: nothing is served without the handshake.
  EXPECT_FALSE(RawUnaryCall(grpc::CreateChannel(server.address(),
                                                grpc::InsecureChannelCredentials()),
                            kHealth, "")
                   .ok());
  EXPECT_EQ(server.service.calls.load(), 1);
}

TEST(InternalAuthTest, MutualTlsWithTokenNeedsBoth) {
  const std::string dir = TempDir();
  MakeCerts(dir);
  InternalAuthOptions o = Tls(dir);
  o.token_file = dir + "/token";
  auto auth = InternalAuth::Create(o);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->Describe(), "mutual TLS + token");
  TestServer server((*auth)->ServerCredentials());
  EXPECT_TRUE(CallStats((*auth)->MakeChannel(server.address())).ok());
  auto tls_only = InternalAuth::Create(Tls(dir));
  ASSERT_TRUE(tls_only.ok());
  EXPECT_EQ(CallStats((*tls_only)->MakeChannel(server.address())).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(server.service.calls.load(), 1);
}

TEST(InternalAuthTest, ReplacedCertificateFilesAreUsedForNewConnections) {
  const std::string dir = TempDir();
  MakeCerts(dir);
  InternalAuthOptions o = Tls(dir);
  o.tls_reload_seconds = 1;
  auto auth = InternalAuth::Create(o);
  ASSERT_TRUE(auth.ok()) << auth.status();
  TestServer server((*auth)->ServerCredentials());
  ASSERT_TRUE(CallStats((*auth)->MakeChannel(server.address())).ok());

  // A new CA and certificates in the same files: a client holding the new ones is accepted
  // once the server has re-read them (polled, at most 30 s), one with the old ones no longer.
  const std::string old_dir = TempDir();
  for (const char* f : {"tls.crt", "tls.key", "ca.crt"}) {
    ASSERT_EQ(std::system(absl::StrCat("cp ", dir, "/", f, " ", old_dir, "/").c_str()), 0);
  }
  MakeCerts(dir, /*force=*/true);
  InternalAuthOptions fresh_o = Tls(dir);
  bool accepted = false;
  for (int i = 0; i < 60 && !accepted; ++i) {
    auto fresh = InternalAuth::Create(fresh_o);  // a new channel: a new connection
    ASSERT_TRUE(fresh.ok());
    accepted = CallStats((*fresh)->MakeChannel(server.address())).ok();
    if (!accepted) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_TRUE(accepted);
  auto old = InternalAuth::Create(Tls(old_dir));
  ASSERT_TRUE(old.ok());
  EXPECT_FALSE(CallStats((*old)->MakeChannel(server.address())).ok());
}

TEST(InternalAuthTest, ApiKeyCheckRefusesBeforeParsingAndCountsRefusals) {
  std::atomic<int> refused{0};
  TestServer server(InsecureServerCredentialsWithProcessor(MakeMetadataProcessor(
      ApiKeyCheck({"key-one", "key-two"}, [&](const std::string&) { ++refused; }))));
  auto plain = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  grpc::Status s = RawUnaryCall(plain, kStats, GarbageMessage(16 << 20));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("missing API key"), std::string::npos) << s.error_message();
  s = RawUnaryCall(plain, kStats, "", {{"authorization", "Bearer key-three"}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(s.error_message(), "invalid API key");
  s = RawUnaryCall(plain, kStats, "", {{"authorization", "Basic a2V5LXR3bw=="}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(s.error_message(),
            "authorization scheme 'Basic' is not supported: send 'authorization: Bearer <key>'");
  EXPECT_EQ(refused.load(), 3);
  EXPECT_EQ(server.service.calls.load(), 0);
  EXPECT_TRUE(RawUnaryCall(plain, kStats, "", {{"authorization", "Bearer key-two"}}).ok());
  EXPECT_TRUE(RawUnaryCall(plain, kHealth, "").ok());
  EXPECT_EQ(server.service.calls.load(), 1);
}

TEST(InternalAuthTest, HealthOnlyPortServesOnlyHealth) {
  ServerOptions o;
  o.metrics_address = "";
  o.health_address = "127.0.0.1:0";
  o.credentials = InsecureServerCredentialsWithProcessor(nullptr);
  CountingDenoise service;
  ServiceRunner runner(o);
  ASSERT_TRUE(runner.Start({&service}, {v1::DenoiseService::service_full_name()}).ok());
  ASSERT_NE(runner.health_port(), 0);
  auto health = grpc::CreateChannel(absl::StrCat("127.0.0.1:", runner.health_port()),
                                    grpc::InsecureChannelCredentials());
  EXPECT_TRUE(RawUnaryCall(health, kHealth, "").ok());
  EXPECT_EQ(CallStats(health).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(service.calls.load(), 0);
}

}  // namespace
}  // namespace dgserve
