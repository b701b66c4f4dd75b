#include "service/address_list.h"

#include "gtest/gtest.h"

namespace dgserve {
namespace {

TEST(AddressListTest, SplitTargetsTrims) {
  EXPECT_EQ(SplitTargets(" a:1, b:2 ,,c:3 "), (std::vector<std::string>{"a:1", "b:2", "c:3"}));
  EXPECT_TRUE(SplitTargets("").empty());
}

TEST(AddressListTest, ValidateTargetAcceptsTheDocumentedForms) {
  for (const char* good : {"127.0.0.1:50051", "localhost:1", "[::1]:65535", "dns:///gw:50051",
                           "dns:///[::1]:7000", "denoise-0.denoise.default.svc:50061",
                           "ipv4:127.0.0.1:5", "ipv6:[::1]:5", "unix:/tmp/gw.sock",
                           "unix-abstract:gw"}) {
    EXPECT_TRUE(ValidateTarget("--gateway", good).ok()) << good;
  }
}

// gRPC would dial 127.0.0.1:18051 for 127.0.0.1:83587 (the port taken modulo 65536).
TEST(AddressListTest, ValidateTargetRefusesWhatGrpcWouldMisread) {
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:", ":50051", "127.0.0.1:0",
                          "127.0.0.1:83587", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:+80",
                          "127.0.0.1:0x50", "127.0.0.1:123456", "::1:50051", "[]:1", "dns:///",
                          "dns:///:50051", "host:50051 ", "unix:", "dns://8.8.8.8/host:5",
                          "http://127.0.0.1:8000", "ipv4:127.0.0.1:70000"}) {
    const absl::Status s = ValidateTarget("--gateway", bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message().find("--gateway: '"), std::string::npos) << s.message();
  }
}

TEST(AddressListTest, ParseTargetsSplitsAndChecksEachEntry) {
  absl::StatusOr<std::vector<std::string>> ok = ParseTargets("--denoise_workers", " a:1, dns:///b:2 ");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, (std::vector<std::string>{"a:1", "dns:///b:2"}));
  const absl::StatusOr<std::vector<std::string>> bad =
      ParseTargets("--denoise_workers", "a:1,127.0.0.1:83587");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--denoise_workers: '127.0.0.1:83587'"), std::string::npos);
  EXPECT_TRUE(ParseTargets("--denoise_workers", "").value().empty());
}

TEST(AddressListTest, ExpandResolvesDnsTargetsOnly) {
  EXPECT_EQ(ExpandTarget("10.0.0.1:5"), (std::vector<std::string>{"10.0.0.1:5"}));
  const std::vector<std::string> local = ExpandTarget("dns:///localhost:7001");
  ASSERT_FALSE(local.empty());
  bool v4 = false;
  for (const std::string& a : local) v4 |= a == "127.0.0.1:7001";
  EXPECT_TRUE(v4);
  EXPECT_TRUE(ExpandTarget("dns:///no-port").empty());
  // A bracketed IPv6 literal (which ValidateTarget accepts) resolves to itself.
  EXPECT_EQ(ExpandTarget("dns:///[::1]:7002"), (std::vector<std::string>{"[::1]:7002"}));
}

TEST(AddressListTest, AllowListAcceptsEntriesAndTheirAddressesOnly) {
  TargetAllowList allowed({"127.0.0.1:7000", "dns:///localhost:7001"});
  EXPECT_TRUE(allowed.Check("127.0.0.1:7000").ok());
  EXPECT_TRUE(allowed.Check("dns:///localhost:7001").ok());
  EXPECT_TRUE(allowed.Check("127.0.0.1:7001").ok());  // what the name resolves to
  for (const char* bad : {"127.0.0.1:7002", "localhost:7000", "unix:/tmp/kv.sock",
                          "dns:///localhost:7000", "10.0.0.1:7000", ""}) {
    const absl::Status s = allowed.Check(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << bad;
    EXPECT_NE(s.message().find("--denoise_workers"), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace dgserve
