#include "service/internal_auth.h"

#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_convert.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/support/client_interceptor.h"

ABSL_FLAG(std::string, internal_tls_cert, "",
          "internal gRPC: this process's certificate chain (PEM); with --internal_tls_key and "
          "--internal_tls_ca every internal call is mutual TLS");
ABSL_FLAG(std::string, internal_tls_key, "", "internal gRPC: the private key (PEM)");
ABSL_FLAG(std::string, internal_tls_ca, "",
          "internal gRPC: the CA certificate (PEM) every peer's certificate must be signed by");
ABSL_FLAG(std::string, internal_tls_server_name, "",
          "internal gRPC: check peers' certificates against this name instead of the dialled "
          "host (a name every worker's certificate carries)");
ABSL_FLAG(int, internal_tls_reload_seconds, 60,
          "internal gRPC: how often the certificate files are re-read");
ABSL_FLAG(std::string, internal_token_file, "",
          "internal gRPC: file holding a shared token; every internal call carries "
          "'authorization: Bearer <token>', checked before the message is read");
ABSL_FLAG(bool, internal_insecure, false,
          "internal gRPC in plaintext without a token: anyone who reaches the ports can call "
          "them (for a trusted host only)");

namespace dgserve {
namespace {

std::string ToString(grpc::string_ref s) { return std::string(s.data(), s.size()); }

class FunctionProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit FunctionProcessor(MetadataCheck check) : check_(std::move(check)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*, OutputMetadata*,
                       OutputMetadata*) override {
    std::string path;
    if (auto it = metadata.find(":path"); it != metadata.end()) path = ToString(it->second);
    return check_(path, metadata);
  }

 private:
  MetadataCheck check_;
};

// The C-level processor over a C++ one, run inline (the filter accepts a synchronous callback).
struct CProcessorState {
  std::shared_ptr<grpc::AuthMetadataProcessor> processor;
};

void CProcess(void* state, grpc_auth_context*, const grpc_metadata* md, size_t num_md,
              grpc_process_auth_metadata_done_cb cb, void* user_data) {
  auto* st = static_cast<CProcessorState*>(state);
  grpc::AuthMetadataProcessor::InputMetadata input;
  for (size_t i = 0; i < num_md; ++i) {
    input.emplace(
        grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].key)),
                         GRPC_SLICE_LENGTH(md[i].key)),
        grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].value)),
                         GRPC_SLICE_LENGTH(md[i].value)));
  }
  grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
  const grpc::Status s = st->processor->Process(input, nullptr, &consumed, &response);
  cb(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(s.error_code()),
     s.ok() ? nullptr : s.error_message().c_str());
}

void CDestroy(void* state) { delete static_cast<CProcessorState*>(state); }

// grpc++'s InsecureServerCredentials() asserts in SetAuthMetadataProcessor; the C-core
// insecure credentials run the server auth filter with a processor, so a port is added with
// those directly.
class InsecureWithProcessor final : public grpc::ServerCredentials {
 public:
  explicit InsecureWithProcessor(std::shared_ptr<grpc::AuthMetadataProcessor> p)
      : processor_(std::move(p)) {}
  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& processor) override {
    processor_ = processor;
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    grpc_server_credentials* creds = grpc_insecure_server_credentials_create();
    if (processor_ != nullptr) {
      grpc_auth_metadata_processor p;
      p.process = CProcess;
      p.destroy = CDestroy;
      p.state = new CProcessorState{processor_};
      grpc_server_credentials_set_auth_metadata_processor(creds, p);
    }
    const int port = grpc_server_add_http2_port(server, addr.c_str(), creds);
    grpc_server_credentials_release(creds);
    return port;
  }

  std::shared_ptr<grpc::AuthMetadataProcessor> processor_;
};

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class TokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::shared_ptr<const std::string> header)
      : header_(std::move(header)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(header_.get());
  }

 private:
  std::shared_ptr<const std::string> header_;  // shared with the channel's other factories
};

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, " ", path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::UnavailableError(absl::StrCat(flag, " ", path, ": read error"));
  return ss.str();
}

}  // namespace

InternalAuthOptions InternalAuthOptionsFromFlags() {
  InternalAuthOptions o;
  o.tls_cert = absl::GetFlag(FLAGS_internal_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_internal_tls_key);
  o.tls_ca = absl::GetFlag(FLAGS_internal_tls_ca);
  o.tls_server_name = absl::GetFlag(FLAGS_internal_tls_server_name);
  o.tls_reload_seconds = absl::GetFlag(FLAGS_internal_tls_reload_seconds);
  o.token_file = absl::GetFlag(FLAGS_internal_token_file);
  o.insecure = absl::GetFlag(FLAGS_internal_insecure);
  return o;
}

std::shared_ptr<grpc::AuthMetadataProcessor> MakeMetadataProcessor(MetadataCheck check) {
  return std::make_shared<FunctionProcessor>(std::move(check));
}

std::shared_ptr<grpc::ServerCredentials> InsecureServerCredentialsWithProcessor(
    std::shared_ptr<grpc::AuthMetadataProcessor> processor) {
  return std::make_shared<InsecureWithProcessor>(std::move(processor));
}

std::string BearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  const std::string value = ToString(it->second);
  if (!absl::StartsWithIgnoreCase(value, "bearer ")) return "";
  return value.substr(7);
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ b[i]);
  return diff == 0;
}

bool IsHealthCheckMethod(const std::string& path) {
  return absl::StartsWith(path, "/grpc.health.v1.Health/");
}

MetadataCheck ApiKeyCheck(std::vector<std::string> keys,
                          std::function<void(const std::string& path)> on_refused) {
  return [keys = std::move(keys), on_refused = std::move(on_refused)](
             const std::string& path,
             const std::multimap<grpc::string_ref, grpc::string_ref>& md) -> grpc::Status {
    if (IsHealthCheckMethod(path)) return grpc::Status::OK;
    const std::string bearer = BearerToken(md);
    bool ok = false;
    for (const std::string& k : keys) ok |= !bearer.empty() && ConstantTimeEquals(bearer, k);
    if (ok) return grpc::Status::OK;
    if (on_refused) on_refused(path);
    if (!bearer.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid API key");
    auto it = md.find("authorization");
    return ToGrpcStatus(MissingBearerTokenError(
        it == md.end() ? absl::string_view()
                       : absl::string_view(it->second.data(), it->second.size()),
        "authorization"));
  };
}

absl::StatusOr<std::shared_ptr<const InternalAuth>> InternalAuth::Create(
    const InternalAuthOptions& options) {
  const bool any_tls =
      !options.tls_cert.empty() || !options.tls_key.empty() || !options.tls_ca.empty();
  const bool all_tls =
      !options.tls_cert.empty() && !options.tls_key.empty() && !options.tls_ca.empty();
  const bool token = !options.token_file.empty();
  if (options.insecure && (any_tls || token)) {
    return absl::InvalidArgumentError(
        "--internal_insecure cannot be combined with --internal_tls_* or --internal_token_file");
  }
  if (!options.insecure && !any_tls && !token) {
    return absl::FailedPreconditionError(
        "internal gRPC calls need credentials: give --internal_tls_cert, --internal_tls_key and "
        "--internal_tls_ca (mutual TLS) and/or --internal_token_file (shared token), or "
        "--internal_insecure for plaintext without authentication (tools/make_internal_certs.sh "
        "makes a local CA, certificates and a token)");
  }
  if (any_tls && !all_tls) {
    return absl::InvalidArgumentError(
        "mutual TLS needs all three of --internal_tls_cert, --internal_tls_key and "
        "--internal_tls_ca");
  }
  if (options.tls_reload_seconds < 1) {
    return absl::InvalidArgumentError("--internal_tls_reload_seconds must be ≥ 1");
  }
  std::shared_ptr<InternalAuth> auth(new InternalAuth(options));
  if (all_tls) {
    // Fail at start on missing files (the watcher would only log).
    for (const auto& [path, flag] : {std::pair{options.tls_cert, "--internal_tls_cert"},
                                     std::pair{options.tls_key, "--internal_tls_key"},
                                     std::pair{options.tls_ca, "--internal_tls_ca"}}) {
      absl::StatusOr<std::string> pem = ReadSmallFile(path, flag);
      if (!pem.ok()) return pem.status();
      if (!absl::StrContains(*pem, "-----BEGIN")) {
        return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file"));
      }
    }
  }
  if (token) {
    absl::StatusOr<std::string> text = ReadSmallFile(options.token_file, "--internal_token_file");
    if (!text.ok()) return text.status();
    auth->token_ = std::string(absl::StripAsciiWhitespace(*text));
    if (auth->token_.size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--internal_token_file ", options.token_file, ": the token must have ≥ 16 characters"));
    }
  }
  return std::shared_ptr<const InternalAuth>(std::move(auth));
}

std::shared_ptr<const InternalAuth> InternalAuth::WithRandomToken() {
  std::shared_ptr<InternalAuth> auth(new InternalAuth(InternalAuthOptions()));
  unsigned char bytes[32] = {0};
  std::ifstream in("/dev/urandom", std::ios::binary);
  in.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  static constexpr char kHex[] = "0123456789abcdef";
  for (unsigned char b : bytes) {
    auth->token_.push_back(kHex[b >> 4]);
    auth->token_.push_back(kHex[b & 15]);
  }
  return auth;
}

std::string InternalAuth::Describe() const {
  if (tls() && token()) return "mutual TLS + token";
  if (tls()) return "mutual TLS";
  if (token()) return "token (plaintext)";
  return "plaintext, unauthenticated";
}

MetadataCheck InternalAuth::TokenCheck() const {
  return [token = token_](const std::string& path,
                          const std::multimap<grpc::string_ref, grpc::string_ref>& md) {
    if (IsHealthCheckMethod(path)) return grpc::Status::OK;
    const std::string bearer = BearerToken(md);
    if (!bearer.empty() && ConstantTimeEquals(bearer, token)) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        bearer.empty() ? "internal call without the cluster token"
                                       : "internal call with a wrong token");
  };
}

std::shared_ptr<grpc::ServerCredentials> InternalAuth::ServerCredentials() const {
  std::shared_ptr<grpc::AuthMetadataProcessor> processor =
      token() ? MakeMetadataProcessor(TokenCheck()) : nullptr;
  if (!tls()) return InsecureServerCredentialsWithProcessor(processor);
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options_.tls_key, options_.tls_cert, options_.tls_ca, options_.tls_reload_seconds);
  grpc::experimental::TlsServerCredentialsOptions o(provider);
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(o);
  if (processor != nullptr) creds->SetAuthMetadataProcessor(processor);
  return creds;
}

std::shared_ptr<grpc::Channel> InternalAuth::MakeChannel(const std::string& target,
                                                         grpc::ChannelArguments args) const {
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (tls()) {
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options_.tls_key, options_.tls_cert, options_.tls_ca, options_.tls_reload_seconds);
    grpc::experimental::TlsChannelCredentialsOptions o;
    o.set_certificate_provider(provider);
    o.watch_root_certs();
    o.watch_identity_key_cert_pairs();
    o.set_verify_server_certs(true);
    creds = grpc::experimental::TlsCredentials(o);
    if (!options_.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options_.tls_server_name);
    }
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  if (!token()) return grpc::CreateCustomChannel(target, creds, args);
  auto header = std::make_shared<const std::string>(absl::StrCat("Bearer ", token_));
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> f;
  f.push_back(std::make_unique<TokenInterceptorFactory>(header));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(f));
}

absl::StatusOr<std::shared_ptr<const InternalAuth>> InternalAuthFromFlags() {
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth =
      InternalAuth::Create(InternalAuthOptionsFromFlags());
  if (!auth.ok()) return auth.status();
  if ((*auth)->insecure()) {
    DGSERVE_LOG_WARNING(
        "*** --internal_insecure: internal gRPC is PLAINTEXT WITHOUT AUTHENTICATION; anyone who "
        "can reach this process's gRPC port can call every internal method (run prefill and "
        "denoise directly, pin KV memory). Use --internal_tls_* and/or --internal_token_file "
        "outside a trusted host. ***");
  } else if (!(*auth)->tls()) {
    // The token travels in clear text: anyone who can watch the pod network can replay it.
    DGSERVE_LOG_WARNING(
        "internal gRPC: %s; without --internal_tls_* the token and all KV travel in clear "
        "text (fine on a trusted host or an encrypted pod network)",
        (*auth)->Describe());
  } else {
    DGSERVE_LOG_INFO("internal gRPC: %s", (*auth)->Describe());
  }
  return auth;
}

std::shared_ptr<grpc::ServerCredentials> HealthOnlyServerCredentials() {
  return InsecureServerCredentialsWithProcessor(MakeMetadataProcessor(
      [](const std::string& path, const std::multimap<grpc::string_ref, grpc::string_ref>&) {
        if (IsHealthCheckMethod(path)) return grpc::Status::OK;
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "this port serves only grpc.health.v1.Health");
      }));
}

}  // namespace dgserve
