// A real local cluster for integration tests: the three service binaries started as child
// processes on loopback ports chosen at run time (--ports_file), stopped by PID. Their internal
// calls are authenticated (a token by default; ClusterOptions::internal_auth).
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dgserve/v1/generation.grpc.pb.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "service/internal_auth.h"

namespace dgserve::testing {

// How the cluster's processes authenticate their internal calls (the --internal_* flags).
enum class InternalAuthMode {
  kToken,             // a token file made for the cluster (the default: quick to set up)
  kMutualTls,         // certificates from tools/make_internal_certs.sh
  kMutualTlsAndToken,
  kInsecure,          // --internal_insecure
};

struct ClusterOptions {
  std::string model_dir;
  InternalAuthMode internal_auth = InternalAuthMode::kToken;
  int denoise_workers = 1;
  std::vector<std::string> prefill_flags;
  std::vector<std::string> denoise_flags;
  std::vector<std::string> gateway_flags;
  // Start returns once the gateway listens, without waiting for /ready (a cluster meant to
  // stay not ready).
  bool wait_until_ready = true;
};

struct Service {
  std::string name;
  pid_t pid = -1;
  int grpc_port = 0;
  int metrics_port = 0;
  int http_port = 0;  // gateway only
  std::string log;
};

class TestCluster {
 public:
  // Starts denoise workers, a prefill worker and the gateway, and waits (bounded) until the
  // gateway's /ready answers 200 (unless options.wait_until_ready is false).
  static absl::StatusOr<std::unique_ptr<TestCluster>> Start(const ClusterOptions& options);
  ~TestCluster();  // SIGTERM, then SIGKILL after 10 s, to the PIDs it started

  const Service& gateway() const { return services_.back(); }
  const Service& prefill() const { return services_[services_.size() - 2]; }
  const Service& denoise(int i) const { return services_[i]; }
  int denoise_count() const { return int(services_.size()) - 2; }
  // SIGKILL one denoise worker.
  void KillDenoise(int i);
  // SIGTERM one denoise worker and wait (bounded: 60 s) until it has exited; false if it had
  // to be killed or exited with a non-zero status.
  bool StopDenoiseGracefully(int i) { return StopGracefully(i); }
  bool StopGatewayGracefully() { return StopGracefully(int(services_.size()) - 1); }
  // Starts denoise worker i again on the same gRPC port (the gateway's address for it).
  absl::Status RestartDenoise(int i);

  std::unique_ptr<v1::GenerationService::Stub> GatewayStub() const;
  // A channel to one of the cluster's internal gRPC ports with the cluster's credentials.
  std::shared_ptr<grpc::Channel> InternalChannel(int grpc_port) const;
  // The cluster's internal credentials (token / certificate files under its directory).
  const InternalAuthOptions& internal_auth_options() const { return auth_options_; }
  const ClusterOptions& options() const { return options_; }
  absl::StatusOr<v1::StatsResponse> DenoiseStats(int i) const;
  absl::StatusOr<v1::StatsResponse> PrefillStats() const;
  // GET http://127.0.0.1:<metrics_port>/metrics of a service.
  static absl::StatusOr<std::string> ScrapeMetrics(const Service& s);
  // The value of a metric line `name{...} value` (first match of name + labels prefix), or -1.
  static double MetricValue(const std::string& text, const std::string& series);

 private:
  bool StopGracefully(int index);

  absl::Status SetUpAuth();  // writes the token / certificates into dir_
  // The --internal_* flags of every process.
  std::vector<std::string> AuthFlags() const;

  std::vector<Service> services_;
  std::string dir_;
  InternalAuthOptions auth_options_;
  std::shared_ptr<const InternalAuth> auth_;
  ClusterOptions options_;
};

// The build directory's binaries and a test model made once per process with dgserve-mkmodel
// (tiny-v512 shape, its cut-down Gemma tokenizer, at most 8 denoising steps).
std::string BinaryPath(const std::string& relative);
absl::StatusOr<std::string> TestModelDir();
// The same model without stop tokens: a request runs until max_tokens or cancelled.
absl::StatusOr<std::string> TestModelDirWithoutStopTokens();
// Options of a cluster serving TestModelDirWithoutStopTokens() with `denoise_workers` workers
// (the other fields at their defaults); the model's error when it cannot be made.
absl::StatusOr<ClusterOptions> OptionsWithoutStopTokens(int denoise_workers = 1);

}  // namespace dgserve::testing
