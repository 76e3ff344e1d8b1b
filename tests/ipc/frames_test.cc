#include "ulysses/ipc/frames.h"

#include <string>

#include "gtest/gtest.h"

namespace ulysses::ipc {
namespace {

TEST(FramesTest, HelloRoundTrips) {
  const std::string text = EncodeHello({42, "0123456789abcdef"});
  absl::StatusOr<HelloFrame> h = DecodeHello(text);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->client_id, 42u);
  EXPECT_EQ(h->token, "0123456789abcdef");
}

TEST(FramesTest, HelloIgnoresUnknownKeys) {
  absl::StatusOr<HelloFrame> h = DecodeHello(R"({"client_id": 7, "token": "t", "extra": [1]})");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->client_id, 7u);
}

struct BadFrame {
  const char* payload;
  const char* names;  // the field the error must name
};

class BadHelloTest : public ::testing::TestWithParam<BadFrame> {};

TEST_P(BadHelloTest, IsInvalidArgumentNamingTheField) {
  absl::StatusOr<HelloFrame> h = DecodeHello(GetParam().payload);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find(GetParam().names), std::string::npos) << h.status();
}

INSTANTIATE_TEST_SUITE_P(
    Frames, BadHelloTest,
    ::testing::Values(BadFrame{R"({"client_id": "1", "token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": null, "token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": -1, "token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": 1.5, "token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": 0, "token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": 18446744073709551616, "token": "t"})", "client_id"},
                      BadFrame{R"({"token": "t"})", "client_id"},
                      BadFrame{R"({"client_id": 1, "token": 7})", "token"},
                      BadFrame{R"({"client_id": 1, "token": ""})", "token"},
                      BadFrame{R"({"client_id": 1})", "token"},
                      BadFrame{R"([1, 2])", "object"},
                      BadFrame{R"("hello")", "object"},
                      BadFrame{"", "JSON"},
                      BadFrame{"{\"client_id\": 1, \"token\": \"t\"", "JSON"},
                      BadFrame{"\xff\xfe", "JSON"}));

TEST(FramesTest, HelloTokenIsBounded) {
  const std::string text = EncodeHello({1, std::string(kMaxTokenBytes + 1, 'a')});
  EXPECT_EQ(DecodeHello(text).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(DecodeHello(EncodeHello({1, std::string(kMaxTokenBytes, 'a')})).ok());
}

TEST(FramesTest, OversizedPayloadIsRefusedUnparsed) {
  std::string text = EncodeHello({1, "t"});
  text.append(kMaxClientFrameBytes, ' ');
  absl::StatusOr<HelloFrame> h = DecodeHello(text);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find("exceed"), std::string::npos) << h.status();
}

TEST(FramesTest, DeepNestingIsAnErrorNotACrash) {
  const std::string deep = std::string(kMaxClientFrameBytes / 2, '[') +
                           std::string(kMaxClientFrameBytes / 2, ']');
  EXPECT_EQ(DecodeHello(deep).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeFdFrame(deep).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FramesTest, FdFrameRoundTrips) {
  absl::StatusOr<FdFrame> f = DecodeFdFrame(EncodeFdFrame({18446744073709551615ull}));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tag, 18446744073709551615ull);
}

class BadFdFrameTest : public ::testing::TestWithParam<BadFrame> {};

TEST_P(BadFdFrameTest, IsInvalidArgumentNamingTheField) {
  absl::StatusOr<FdFrame> f = DecodeFdFrame(GetParam().payload);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find(GetParam().names), std::string::npos) << f.status();
}

INSTANTIATE_TEST_SUITE_P(Frames, BadFdFrameTest,
                         ::testing::Values(BadFrame{R"({"tag": "7"})", "tag"},
                                           BadFrame{R"({"tag": -7})", "tag"},
                                           BadFrame{R"({"tag": null})", "tag"},
                                           BadFrame{R"({"tag": true})", "tag"},
                                           BadFrame{R"({"tag": 7.0})", "tag"},
                                           BadFrame{R"({})", "tag"},
                                           BadFrame{R"(7)", "object"},
                                           BadFrame{"tag", "JSON"}));

}  // namespace
}  // namespace ulysses::ipc
