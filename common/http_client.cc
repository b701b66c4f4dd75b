#include "common/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace dgserve {
namespace {

// (Debian's Abseil has its own string_view type, so these take std::string_view themselves.)
bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view StripSpaces(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Milliseconds for a curl timeout option; 0 (curl's "no limit") for an infinite duration.
long TimeoutMs(absl::Duration d) {
  if (d == absl::InfiniteDuration() || d <= absl::ZeroDuration()) return 0;
  return static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// State shared with curl's callbacks during one transfer.
struct Transfer {
  HttpResponse* response = nullptr;
  const HttpClient::ChunkCallback* on_chunk = nullptr;  // null: keep the body in response->body
  const HttpRequest* request = nullptr;
  std::string_view upload;  // what the chunked read callback still has to send
  absl::Duration idle_timeout;
  absl::Time last_activity = absl::Now();
  curl_off_t last_dl = 0, last_ul = 0;
  bool aborted = false;  // the chunk callback or is_cancelled stopped the transfer
  bool idle = false;     // the idle timeout stopped the transfer
};

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string_view line(data, size * n);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  if (line.substr(0, 5) == "HTTP/") {  // a new response head (after 100 Continue, say)
    t->response->headers.clear();
    const size_t sp = line.find(' ');
    t->response->status =
        sp == std::string_view::npos ? 0 : std::atoi(std::string(line.substr(sp + 1, 3)).c_str());
    return size * n;
  }
  const size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    t->response->headers.emplace_back(std::string(line.substr(0, colon)),
                                      std::string(StripSpaces(line.substr(colon + 1))));
  }
  t->last_activity = absl::Now();
  return size * n;
}

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string_view chunk(data, size * n);
  t->last_activity = absl::Now();
  if (t->request->is_cancelled && t->request->is_cancelled()) {
    t->aborted = true;
    return 0;  // != size * n: curl stops with CURLE_WRITE_ERROR
  }
  if (t->on_chunk == nullptr) {
    t->response->body.append(chunk);
  } else if (!(*t->on_chunk)(*t->response, chunk)) {
    t->aborted = true;
    return 0;
  }
  return size * n;
}

size_t OnUpload(char* buffer, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = std::min(size * n, t->upload.size());
  std::memcpy(buffer, t->upload.data(), len);
  t->upload.remove_prefix(len);
  return len;  // 0 ends the body (the last, empty chunk)
}

int OnProgress(void* user, curl_off_t, curl_off_t dlnow, curl_off_t, curl_off_t ulnow) {
  auto* t = static_cast<Transfer*>(user);
  if (t->request->is_cancelled && t->request->is_cancelled()) {
    t->aborted = true;
    return 1;  // curl stops with CURLE_ABORTED_BY_CALLBACK
  }
  const absl::Time now = absl::Now();
  if (dlnow != t->last_dl || ulnow != t->last_ul) {
    t->last_dl = dlnow;
    t->last_ul = ulnow;
    t->last_activity = now;
  }
  if (t->idle_timeout != absl::InfiniteDuration() && now - t->last_activity > t->idle_timeout) {
    t->idle = true;
    return 1;
  }
  return 0;
}

std::string ErrorKind(CURLcode code, const Transfer& t) {
  if (t.idle) return "timeout";
  if (t.aborted) return "aborted";
  switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
      return "connect";
    case CURLE_OPERATION_TIMEDOUT:
      return "timeout";
    case CURLE_SEND_ERROR:
      return "send";
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
      return "recv";
    default:
      return "other";
  }
}

bool HasHeader(const HttpHeaders& headers, std::string_view name) {
  return std::any_of(headers.begin(), headers.end(),
                     [&](const auto& h) { return EqualsIgnoreCase(h.first, name); });
}

}  // namespace

std::string HttpResponse::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (EqualsIgnoreCase(k, name)) return v;
  }
  return "";
}

size_t HttpResponse::HeaderCount(std::string_view name) const {
  return static_cast<size_t>(std::count_if(headers.begin(), headers.end(), [&](const auto& h) {
    return EqualsIgnoreCase(h.first, name);
  }));
}

HttpClient::HttpClient(std::string host, int port) : host_(std::move(host)), port_(port) {
  static std::once_flag init;
  std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  curl_ = curl_easy_init();
}

HttpClient::~HttpClient() {
  if (curl_ != nullptr) curl_easy_cleanup(static_cast<CURL*>(curl_));
}

HttpClient::HttpClient(HttpClient&& other) noexcept
    : host_(std::move(other.host_)),
      port_(other.port_),
      timeout_(other.timeout_),
      connect_timeout_(other.connect_timeout_),
      idle_timeout_(other.idle_timeout_),
      curl_(std::exchange(other.curl_, nullptr)) {}

HttpClient& HttpClient::operator=(HttpClient&& other) noexcept {
  if (this != &other) {
    if (curl_ != nullptr) curl_easy_cleanup(static_cast<CURL*>(curl_));
    host_ = std::move(other.host_);
    port_ = other.port_;
    timeout_ = other.timeout_;
    connect_timeout_ = other.connect_timeout_;
    idle_timeout_ = other.idle_timeout_;
    curl_ = std::exchange(other.curl_, nullptr);
  }
  return *this;
}

HttpResponse HttpClient::Send(const HttpRequest& request) { return Perform(request, nullptr); }

HttpResponse HttpClient::Stream(const HttpRequest& request, const ChunkCallback& on_chunk) {
  return Perform(request, &on_chunk);
}

HttpResponse HttpClient::Get(const std::string& path, const HttpHeaders& headers) {
  HttpRequest r;
  r.path = path;
  r.headers = headers;
  return Send(r);
}

HttpResponse HttpClient::Post(const std::string& path, const std::string& body,
                              const HttpHeaders& headers, const std::string& content_type) {
  HttpRequest r;
  r.method = "POST";
  r.path = path;
  r.headers = headers;
  if (!HasHeader(headers, "Content-Type")) r.headers.emplace_back("Content-Type", content_type);
  r.body = body;
  return Send(r);
}

HttpResponse HttpClient::Delete(const std::string& path, const HttpHeaders& headers) {
  HttpRequest r;
  r.method = "DELETE";
  r.path = path;
  r.headers = headers;
  return Send(r);
}

HttpResponse HttpClient::Perform(const HttpRequest& request, const ChunkCallback* on_chunk) {
  HttpResponse response;
  auto* curl = static_cast<CURL*>(curl_);
  if (curl == nullptr) {
    response.error = "curl_easy_init failed";
    response.error_kind = "other";
    return response;
  }
  // Clears the previous request's options; the open connection stays in the handle's cache.
  curl_easy_reset(curl);
  Transfer t;
  t.response = &response;
  t.on_chunk = on_chunk;
  t.request = &request;
  t.upload = request.body;
  t.idle_timeout = idle_timeout_;

  const bool ipv6 = host_.find(':') != std::string::npos && host_.front() != '[';
  const std::string url =
      absl::StrCat("http://", ipv6 ? "[" : "", host_, ipv6 ? "]" : "", ":", port_, request.path);
  char error_buffer[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  curl_easy_setopt(curl, CURLOPT_PROXY, "");  // never an http_proxy from the environment
  curl_easy_setopt(curl, CURLOPT_TCP_NODELAY, 1L);
  const absl::Duration timeout =
      request.timeout > absl::ZeroDuration() ? request.timeout : timeout_;
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, TimeoutMs(timeout));
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, TimeoutMs(connect_timeout_));
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &OnBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, &OnProgress);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &t);

  curl_slist* headers = nullptr;
  for (const auto& [name, value] : request.headers) {
    // "Name;" is curl's spelling of a header with an empty value ("Name:" would remove it).
    const std::string line =
        value.empty() ? absl::StrCat(name, ";") : absl::StrCat(name, ": ", value);
    headers = curl_slist_append(headers, line.c_str());
  }
  // No "Expect: 100-continue" (curl adds it to bodies over 1 KiB and then waits for it).
  if (!HasHeader(request.headers, "Expect")) headers = curl_slist_append(headers, "Expect:");
  if (request.chunked_body) headers = curl_slist_append(headers, "Transfer-Encoding: chunked");

  if (request.chunked_body) {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, &OnUpload);
    curl_easy_setopt(curl, CURLOPT_READDATA, &t);
    if (request.method != "POST") {
      curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
    }
  } else if (request.method == "GET" && request.body.empty()) {
    curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  } else if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else {
    if (!request.body.empty() || request.method == "POST" || request.method == "PUT") {
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, request.body.data());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE,
                       static_cast<curl_off_t>(request.body.size()));
    }
    if (request.method != "POST") {
      curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
    }
  }
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);

  const CURLcode code = curl_easy_perform(curl);
  long connects = 0;
  curl_easy_getinfo(curl, CURLINFO_NUM_CONNECTS, &connects);
  response.new_connections = static_cast<int>(connects);
  // The handle keeps pointers to these options until the next reset.
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, nullptr);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, nullptr);
  curl_slist_free_all(headers);
  if (code != CURLE_OK) {
    response.error_kind = ErrorKind(code, t);
    if (t.idle) {
      response.error = absl::StrCat("no byte for ", absl::FormatDuration(idle_timeout_));
    } else if (t.aborted) {
      response.error = "aborted by the callback";
    } else {
      response.error = error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(code);
    }
  }
  return response;
}

}  // namespace dgserve
