// For the targets that parse protobuf messages: the library logs every string field that is
// not UTF-8 (a parse failure the targets expect), which would slow the run to a crawl.
#pragma once

#include "google/protobuf/stubs/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
