#include "service/server.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "CivetServer.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/openmp_env.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "nlohmann/json.hpp"
#include "service/internal_auth.h"

namespace dgserve {
namespace {

std::atomic<int> g_signal{0};

// The metrics port's civetweb begin_request callback (it runs before any handler): answers
// HEAD /metrics, which prometheus-cpp leaves to civetweb's 404 (its handler has a GET only),
// with a GET's status and Content-Type and no content (no Content-Length: that of a GET is not
// known without collecting, RFC 9110 §8.6). Returns 0 for anything else: civetweb goes on.
int AnswerMetricsHead(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  if (info == nullptr || info->request_method == nullptr || info->local_uri == nullptr ||
      std::strcmp(info->request_method, "HEAD") != 0 ||
      std::strcmp(info->local_uri, "/metrics") != 0) {
    return 0;
  }
  mg_printf(conn, "%s",
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Connection: close\r\n\r\n");
  return 200;
}

}  // namespace

PeriodicTask::PeriodicTask(absl::Duration period, std::function<void()> fn)
    : thread_([this, period, fn = std::move(fn)] {
        absl::MutexLock lock(&mu_);
        while (!stop_) {
          mu_.Unlock();
          fn();
          mu_.Lock();
          mu_.AwaitWithTimeout(absl::Condition(&stop_), period);
        }
      }) {}

PeriodicTask::~PeriodicTask() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "': expected host:port with a port in 0..65535"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, port);
}

namespace {
// A listen address gRPC or civetweb would misread is refused, naming the flag: gRPC took port
// 65536 + p as p, an address without a port as port 443, and reported an unparsable one as a
// port in use. gRPC's unix: addresses pass as they are.
absl::Status CheckListenAddress(const char* flag, const std::string& address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return absl::OkStatus();
  }
  absl::StatusOr<std::pair<std::string, int>> hp = SplitHostPort(address);
  if (hp.ok() && hp->first.empty()) {
    hp = absl::InvalidArgumentError(absl::StrCat(
        "address '", address, "': no host (0.0.0.0 for every IPv4 interface, [::] for IPv6)"));
  }
  if (hp.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", hp.status().message()));
}
}  // namespace

ServiceRunner::ServiceRunner(ServerOptions options)
    : options_(std::move(options)), registry_(std::make_shared<prometheus::Registry>()) {}

ServiceRunner::~ServiceRunner() { Shutdown(absl::ZeroDuration()); }

void ServiceRunner::BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int ServiceRunner::WaitForSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
  g_signal = sig;
  return sig;
}

absl::Status ServiceRunner::Start(const std::vector<grpc::Service*>& services,
                                  const std::vector<std::string>& service_names) {
  service_names_ = service_names;
  DGSERVE_RETURN_IF_ERROR(CheckListenAddress("--grpc_address", options_.grpc_address));
  if (!options_.health_address.empty()) {
    DGSERVE_RETURN_IF_ERROR(CheckListenAddress("--health_address", options_.health_address));
  }
  if (!options_.metrics_address.empty()) {
    DGSERVE_RETURN_IF_ERROR(CheckListenAddress("--metrics_address", options_.metrics_address));
    try {
      CivetCallbacks callbacks;  // copied by the server
      callbacks.begin_request = &AnswerMetricsHead;
      exposer_ = std::make_unique<prometheus::Exposer>(options_.metrics_address, 2, &callbacks);
      exposer_->RegisterCollectable(registry_);
      const std::vector<int> ports = exposer_->GetListeningPorts();
      metrics_port_ = ports.empty() ? 0 : ports.front();
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("metrics address ", options_.metrics_address,
                                                 ": cannot listen (", e.what(), ")"));
    }
  }
  // Links the health proto's descriptor into the pool reflection serves.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second process given a port in use must fail to start, not share the
  // port and take some of the connections (gRPC enables it by default on Linux).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options_.grpc_address,
                           options_.credentials ? options_.credentials
                                                : grpc::InsecureServerCredentials(),
                           &grpc_port_);
  if (!options_.health_address.empty()) {
    builder.AddListeningPort(options_.health_address, HealthOnlyServerCredentials(),
                             &health_port_);
  }
  builder.SetMaxReceiveMessageSize(options_.max_receive_message_bytes > 0
                                       ? options_.max_receive_message_bytes
                                       : options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  for (grpc::Service* s : services) builder.RegisterService(s);
  static std::once_flag quiet_once;
  std::call_once(quiet_once, QuietProtobufParseErrors);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(MakeUnparsableRequestInterceptorFactory(options_.on_unparsable_request));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  server_ = builder.BuildAndStart();
  const bool with_health = !options_.health_address.empty();
  if (!server_ || grpc_port_ == 0 || (with_health && health_port_ == 0)) {
    // gRPC builds no server when any port fails to bind; the selected port of each one bound
    // says which failed (a bound one is non-zero).
    if (server_) server_->Shutdown();
    server_.reset();
    const std::string grpc = absl::StrCat("--grpc_address ", options_.grpc_address);
    const std::string health = absl::StrCat("--health_address ", options_.health_address);
    // (An address on port 0 takes any free port: it is not the one that failed.)
    const bool grpc_any_port = absl::EndsWith(options_.grpc_address, ":0");
    if (with_health && health_port_ == 0 && (grpc_port_ != 0 || grpc_any_port)) {
      return absl::UnavailableError(absl::StrCat(health, ": cannot listen (port in use?)"));
    }
    if (!with_health || health_port_ != 0 || absl::EndsWith(options_.health_address, ":0")) {
      return absl::UnavailableError(absl::StrCat(grpc, ": cannot listen (port in use?)"));
    }
    return absl::UnavailableError(
        absl::StrCat(grpc, " or ", health, ": cannot listen (port in use?)"));
  }
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    for (const std::string& name : service_names_) health->SetServingStatus(name, true);
  }
  return absl::OkStatus();
}

void ServiceRunner::SetServing(bool serving) {
  if (server_ && server_->GetHealthCheckService()) {
    server_->GetHealthCheckService()->SetServingStatus(serving);
    for (const std::string& name : service_names_) {
      server_->GetHealthCheckService()->SetServingStatus(name, serving);
    }
  }
}

absl::Status ServiceRunner::WritePortsFile(const std::vector<std::pair<std::string, int>>& extra) {
  if (options_.ports_file.empty()) return absl::OkStatus();
  nlohmann::json j = {{"grpc", grpc_port_}, {"metrics", metrics_port_}, {"pid", ::getpid()}};
  if (health_port_ != 0) j["health"] = health_port_;
  for (const auto& [k, v] : extra) j[k] = v;
  const std::string tmp = options_.ports_file + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump() << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), options_.ports_file.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", options_.ports_file));
  }
  return absl::OkStatus();
}

void ServiceRunner::Shutdown(absl::Duration grace) {
  if (server_) {
    SetServing(false);
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
    server_->Wait();
    server_.reset();
  }
  exposer_.reset();
}

int ServiceMain(int argc, char** argv, const char* usage, const char* flags_file,
                absl::Status (*run)()) {
  UsePassiveOpenMpWaitUnlessSet(argv);
  ServiceRunner::BlockTerminationSignals();
  InitCommandLine(usage, flags_file);
  // --help lists the binary's own flags, the shared --internal_* ones and the backend's.
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [flags_file](absl::string_view f) {
    return absl::StrContains(f, flags_file) || absl::StrContains(f, "service/internal_auth.cc") ||
           absl::StrContains(f, "worker/backend_flags.cc");
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  // (A member left unset is reset to Abseil's default: InitCommandLine's version is kept.)
  config.version_string = VersionString;
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> rest = ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
  absl::Status s = run();
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

std::string ServedModelId(const std::string& dir, const std::string& flag) {
  if (!flag.empty()) return flag;
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const size_t slash = d.rfind('/');
  return slash == std::string::npos ? d : d.substr(slash + 1);
}

}  // namespace dgserve
