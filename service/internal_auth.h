// Authentication of the calls between gateway, prefill and denoise workers (mutual TLS and/or
// a shared bearer token), and of the gateway's public gRPC port (API keys). Every check runs in
// gRPC's server auth filter on a call's initial metadata: a refused call ends UNAUTHENTICATED
// before its message is read or parsed, and its handler never runs.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace dgserve {

// How a process authenticates its internal gRPC calls (server and client side alike).
// From the flags --internal_tls_cert/_key/_ca, --internal_token_file, --internal_insecure.
struct InternalAuthOptions {
  std::string tls_cert;  // PEM: this process's certificate chain (server and client identity)
  std::string tls_key;   // PEM: its private key
  std::string tls_ca;    // PEM: the CA that signs every peer's certificate
  // Name the peers' certificates are checked against instead of the dialled host (one name in
  // every worker's certificate, e.g. for pods dialled by IP); empty: the dialled host.
  std::string tls_server_name;
  int tls_reload_seconds = 60;  // certificate files are re-read this often
  std::string token_file;       // a file holding the shared token (surrounding space ignored)
  bool insecure = false;        // plaintext without a token: only by explicit choice
};

// The --internal_* flags (defined in internal_auth.cc, shared by all three binaries).
InternalAuthOptions InternalAuthOptionsFromFlags();

// A checker of a call's request headers, run before its message is read. `path` is the
// method's full name ("/pkg.Service/Method"). Returns OK to let the call through; any other
// status ends the call with it.
using MetadataCheck = std::function<grpc::Status(
    const std::string& path, const std::multimap<grpc::string_ref, grpc::string_ref>& metadata)>;

// An AuthMetadataProcessor that runs `check` inline on gRPC's thread (non-blocking).
std::shared_ptr<grpc::AuthMetadataProcessor> MakeMetadataProcessor(MetadataCheck check);

// Plaintext server credentials whose every call passes `processor` first, in gRPC's server
// auth filter (the C-core insecure credentials with a C-level processor: grpc++'s
// InsecureServerCredentials() cannot take one). Calling SetAuthMetadataProcessor replaces it.
std::shared_ptr<grpc::ServerCredentials> InsecureServerCredentialsWithProcessor(
    std::shared_ptr<grpc::AuthMetadataProcessor> processor);

// The value of the first "authorization: Bearer <value>" header, or "" (scheme matched
// without regard to case).
std::string BearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);
// Equality in time independent of where `a` and `b` differ (their lengths may leak).
bool ConstantTimeEquals(const std::string& a, const std::string& b);
// The health service's methods (left open for probes on every port).
bool IsHealthCheckMethod(const std::string& path);

// A check requiring "authorization: Bearer <k>" for one of `keys` on every method except the
// health service's; `on_refused` (may be empty) is called with each refused call's path.
// Refused calls get UNAUTHENTICATED ("missing API key", a scheme that is not Bearer, or
// "invalid API key").
MetadataCheck ApiKeyCheck(std::vector<std::string> keys,
                          std::function<void(const std::string& path)> on_refused = {});

// One process's internal credentials, made once at start and shared by its server and its
// clients. Thread-safe.
class InternalAuth {
 public:
  // Validates the options and reads the token and certificate files. FAILED_PRECONDITION naming
  // the flags when nothing is configured (plaintext must be asked for with --internal_insecure);
  // INVALID_ARGUMENT for --internal_insecure combined with credentials, a partial TLS triple, or
  // an empty token; NOT_FOUND / UNAVAILABLE for unreadable files.
  static absl::StatusOr<std::shared_ptr<const InternalAuth>> Create(
      const InternalAuthOptions& options);

  // Token mode with a random token of this process (for workers and clients in one process,
  // e.g. dgserve-server's loopback worker port).
  static std::shared_ptr<const InternalAuth> WithRandomToken();

  bool tls() const { return !options_.tls_cert.empty(); }
  bool token() const { return !token_.empty(); }
  bool insecure() const { return options_.insecure; }
  // "mutual TLS + token", "mutual TLS", "token (plaintext)", "plaintext, unauthenticated".
  std::string Describe() const;

  // Server credentials of an internal port: TLS requiring and verifying a client certificate
  // from the CA (when configured) and the token checked on every method but the health
  // service's (when configured).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // A channel to another internal service with this process's client credentials; every call
  // on it carries the token.
  std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                             grpc::ChannelArguments args = {}) const;
  // The token check alone (for tests and custom ports).
  MetadataCheck TokenCheck() const;

 private:
  explicit InternalAuth(InternalAuthOptions options) : options_(std::move(options)) {}
  InternalAuthOptions options_;
  std::string token_;
};

// InternalAuth::Create from the flags, logging the mode; plaintext is logged as a warning
// that anyone reaching the ports can call them.
absl::StatusOr<std::shared_ptr<const InternalAuth>> InternalAuthFromFlags();

// Plaintext server credentials that serve only the health service (every other method is
// UNAUTHENTICATED): a probe port for kubelet, which cannot present a client certificate.
std::shared_ptr<grpc::ServerCredentials> HealthOnlyServerCredentials();

}  // namespace dgserve
