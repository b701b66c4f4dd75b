#include "tests/integration/test_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/http_client.h"
#include "common/testing/temp_dir.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace dgserve::testing {
namespace {

std::string TempDir() { return MakeTempDirRemovedAtExit("dgserve_it"); }

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot start ", argv[0]));
  return pid;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits for the ports file of `s` (bounded: 120 s), failing early if the process exited.
absl::Status WaitPorts(Service& s, const std::string& file) {
  for (int i = 0; i < 1200; ++i) {
    const std::string text = ReadFile(file);
    if (!text.empty()) {
      nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_object()) {
        s.grpc_port = j.value("grpc", 0);
        s.metrics_port = j.value("metrics", 0);
        s.http_port = j.value("http", 0);
        return absl::OkStatus();
      }
    }
    int status = 0;
    if (waitpid(s.pid, &status, WNOHANG) == s.pid) {
      s.pid = -1;
      return absl::InternalError(absl::StrCat(s.name, " exited: ", ReadFile(s.log)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat(s.name, " did not start: ", ReadFile(s.log)));
}

}  // namespace

std::string BinaryPath(const std::string& relative) {
  return absl::StrCat(DGSERVE_BINARY_DIR, "/", relative);
}

namespace {

// The tiny-v512 test model with the given `eos_token_id` JSON.
absl::StatusOr<std::string> MakeTestModel(const std::string& name, const std::string& eos_json) {
  const std::string d = TempDir() + "/" + name;
  const std::string src = absl::StrCat(DGSERVE_SOURCE_DIR_PATH, "/tests/testdata/golden/tiny-v512");
  const std::string gen = TempDir() + "/generation_config.json";
  std::ofstream(gen) << R"({"max_denoising_steps": 8, "max_new_tokens": 32, "t_min": 0.4,
    "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005, "pad_token_id": 0,
    "eos_token_id": )" << eos_json << R"(, "sampler_config": {"entropy_bound": 0.1}})";
  const std::string cmd = absl::StrCat(BinaryPath("tools/dgserve-mkmodel"), " --out ", d,
                                       " --seed 512 --config ", src, "/config.json --tokenizer ",
                                       src, "/tokenizer.json --generation_config ", gen,
                                       " > /dev/null 2>&1");
  if (std::system(cmd.c_str()) != 0) return absl::InternalError("dgserve-mkmodel failed");
  return d;
}

}  // namespace

absl::StatusOr<std::string> TestModelDir() {
  static std::string dir;
  if (!dir.empty()) return dir;
  absl::StatusOr<std::string> d = MakeTestModel("it-model", "[1, 106, 50]");
  if (!d.ok()) return d.status();
  dir = *d;
  return dir;
}

absl::StatusOr<std::string> TestModelDirWithoutStopTokens() {
  static std::string dir;
  if (!dir.empty()) return dir;
  absl::StatusOr<std::string> d = MakeTestModel("it-model-no-eos", "[]");
  if (!d.ok()) return d.status();
  dir = *d;
  return dir;
}

absl::StatusOr<ClusterOptions> OptionsWithoutStopTokens(int denoise_workers) {
  absl::StatusOr<std::string> model = TestModelDirWithoutStopTokens();
  if (!model.ok()) return model.status();
  ClusterOptions o;
  o.model_dir = *model;
  o.denoise_workers = denoise_workers;
  return o;
}

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(const ClusterOptions& o) {
  auto c = std::unique_ptr<TestCluster>(new TestCluster());
  c->dir_ = TempDir();
  c->options_ = o;
  if (auto s = c->SetUpAuth(); !s.ok()) return s;
  auto launch = [&](const std::string& name, const std::string& bin,
                    std::vector<std::string> args) -> absl::Status {
    Service s;
    s.name = name;
    s.log = c->dir_ + "/" + name + ".log";
    const std::string ports = c->dir_ + "/" + name + ".ports";
    std::vector<std::string> argv = {BinaryPath(bin), "--model", o.model_dir, "--ports_file",
                                     ports};
    const std::vector<std::string> auth = c->AuthFlags();
    argv.insert(argv.end(), auth.begin(), auth.end());
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<pid_t> pid = Spawn(argv, s.log);
    if (!pid.ok()) return pid.status();
    s.pid = *pid;
    c->services_.push_back(s);
    return absl::OkStatus();
  };
  for (int i = 0; i < o.denoise_workers; ++i) {
    if (auto s = launch(absl::StrCat("denoise", i), "denoise_worker/dgserve-denoise-worker",
                        o.denoise_flags);
        !s.ok()) {
      return s;
    }
  }
  std::vector<std::string> denoise_addrs;
  for (Service& s : c->services_) {
    if (auto st = WaitPorts(s, c->dir_ + "/" + s.name + ".ports"); !st.ok()) return st;
    denoise_addrs.push_back(absl::StrCat("127.0.0.1:", s.grpc_port));
  }
  // The prefill worker accepts KV targets among the denoise workers only.
  std::vector<std::string> prefill_args = {"--denoise_workers", absl::StrJoin(denoise_addrs, ",")};
  prefill_args.insert(prefill_args.end(), o.prefill_flags.begin(), o.prefill_flags.end());
  if (auto s = launch("prefill", "prefill_worker/dgserve-prefill-worker", prefill_args);
      !s.ok()) {
    return s;
  }
  if (auto st = WaitPorts(c->services_.back(), c->dir_ + "/prefill.ports"); !st.ok()) return st;
  const std::string prefill_addr = absl::StrCat("127.0.0.1:", c->services_.back().grpc_port);
  std::vector<std::string> gw = {"--prefill_workers", prefill_addr, "--denoise_workers",
                                 absl::StrJoin(denoise_addrs, ",")};
  gw.insert(gw.end(), o.gateway_flags.begin(), o.gateway_flags.end());
  if (auto s = launch("gateway", "gateway/dgserve-gateway", gw); !s.ok()) return s;
  if (auto s = WaitPorts(c->services_.back(), c->dir_ + "/gateway.ports"); !s.ok()) return s;
  if (!o.wait_until_ready) return c;
  HttpClient http("127.0.0.1", c->gateway().http_port);
  http.set_timeout(absl::Seconds(5));
  for (int i = 0; i < 600; ++i) {
    auto r = http.Get("/ready");
    if (r && r.status == 200) return c;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError("gateway never became ready");
}

TestCluster::~TestCluster() {
  for (const Service& s : services_) {
    if (s.pid > 0) kill(s.pid, SIGTERM);
  }
  for (const Service& s : services_) {
    if (s.pid <= 0) continue;
    int status = 0;
    for (int i = 0; i < 100 && waitpid(s.pid, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (waitpid(s.pid, &status, WNOHANG) == 0) {
      kill(s.pid, SIGKILL);
      waitpid(s.pid, &status, 0);
    }
  }
}

void TestCluster::KillDenoise(int i) {
  if (services_[i].pid <= 0) return;
  kill(services_[i].pid, SIGKILL);
  int status = 0;
  waitpid(services_[i].pid, &status, 0);
  services_[i].pid = -1;
}

bool TestCluster::StopGracefully(int i) {
  Service& s = services_[i];
  if (s.pid <= 0) return false;
  kill(s.pid, SIGTERM);
  int status = 0;
  for (int t = 0; t < 600; ++t) {
    if (waitpid(s.pid, &status, WNOHANG) == s.pid) {
      s.pid = -1;
      return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(s.pid, SIGKILL);
  waitpid(s.pid, &status, 0);
  s.pid = -1;
  return false;
}

absl::Status TestCluster::RestartDenoise(int i) {
  Service& s = services_[i];
  const std::string ports = absl::StrCat(dir_, "/", s.name, ".restart.ports");
  std::vector<std::string> argv = {BinaryPath("denoise_worker/dgserve-denoise-worker"),
                                   "--model", options_.model_dir, "--ports_file", ports,
                                   "--grpc_address", absl::StrCat("127.0.0.1:", s.grpc_port)};
  const std::vector<std::string> auth = AuthFlags();
  argv.insert(argv.end(), auth.begin(), auth.end());
  argv.insert(argv.end(), options_.denoise_flags.begin(), options_.denoise_flags.end());
  absl::StatusOr<pid_t> pid = Spawn(argv, s.log + ".restart");
  if (!pid.ok()) return pid.status();
  s.pid = *pid;
  return WaitPorts(s, ports);
}

std::unique_ptr<v1::GenerationService::Stub> TestCluster::GatewayStub() const {
  return v1::GenerationService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", gateway().grpc_port), grpc::InsecureChannelCredentials()));
}

absl::Status TestCluster::SetUpAuth() {
  const InternalAuthMode mode = options_.internal_auth;
  if (mode == InternalAuthMode::kInsecure) {
    auth_options_.insecure = true;
  } else if (mode == InternalAuthMode::kToken) {
    std::ifstream urandom("/dev/urandom", std::ios::binary);
    unsigned char bytes[24];
    urandom.read(reinterpret_cast<char*>(bytes), sizeof bytes);
    std::string token;
    for (unsigned char b : bytes) token += absl::StrCat(absl::Hex(b, absl::kZeroPad2));
    auth_options_.token_file = dir_ + "/internal.token";
    std::ofstream(auth_options_.token_file) << token << "\n";
  } else {
    const std::string certs = dir_ + "/certs";
    const std::string cmd = absl::StrCat(DGSERVE_SOURCE_DIR_PATH, "/tools/make_internal_certs.sh ",
                                         certs, " >/dev/null");
    if (std::system(cmd.c_str()) != 0) return absl::InternalError(absl::StrCat("failed: ", cmd));
    auth_options_.tls_cert = certs + "/tls.crt";
    auth_options_.tls_key = certs + "/tls.key";
    auth_options_.tls_ca = certs + "/ca.crt";
    if (mode == InternalAuthMode::kMutualTlsAndToken) auth_options_.token_file = certs + "/token";
  }
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuth::Create(auth_options_);
  if (!auth.ok()) return auth.status();
  auth_ = *auth;
  return absl::OkStatus();
}

std::vector<std::string> TestCluster::AuthFlags() const {
  std::vector<std::string> f;
  if (auth_options_.insecure) f.push_back("--internal_insecure");
  if (!auth_options_.token_file.empty()) {
    f.push_back(absl::StrCat("--internal_token_file=", auth_options_.token_file));
  }
  if (!auth_options_.tls_cert.empty()) {
    f.push_back(absl::StrCat("--internal_tls_cert=", auth_options_.tls_cert));
    f.push_back(absl::StrCat("--internal_tls_key=", auth_options_.tls_key));
    f.push_back(absl::StrCat("--internal_tls_ca=", auth_options_.tls_ca));
  }
  return f;
}

std::shared_ptr<grpc::Channel> TestCluster::InternalChannel(int grpc_port) const {
  return auth_->MakeChannel(absl::StrCat("127.0.0.1:", grpc_port));
}

absl::StatusOr<v1::StatsResponse> TestCluster::DenoiseStats(int i) const {
  auto stub = v1::DenoiseService::NewStub(InternalChannel(denoise(i).grpc_port));
  grpc::ClientContext ctx;
  v1::StatsResponse r;
  grpc::Status s = stub->Stats(&ctx, v1::StatsRequest(), &r);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return r;
}

absl::StatusOr<v1::StatsResponse> TestCluster::PrefillStats() const {
  auto stub = v1::PrefillService::NewStub(InternalChannel(prefill().grpc_port));
  grpc::ClientContext ctx;
  v1::StatsResponse r;
  grpc::Status s = stub->Stats(&ctx, v1::StatsRequest(), &r);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return r;
}

absl::StatusOr<std::string> TestCluster::ScrapeMetrics(const Service& s) {
  HttpClient http("127.0.0.1", s.metrics_port);
  auto r = http.Get("/metrics");
  if (!r || r.status != 200) return absl::UnavailableError("metrics scrape failed");
  return r.body;
}

double TestCluster::MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.substr(0, series.size()) != series) continue;
    const size_t sp = line.rfind(' ');
    if (sp == absl::string_view::npos) continue;
    return std::strtod(std::string(line.substr(sp + 1)).c_str(), nullptr);
  }
  return -1;
}

}  // namespace dgserve::testing
