# Precompiled headers (ULYSSES_PCH): much of the build's compile time is spent parsing the
# distribution's gRPC, protobuf, Abseil, spdlog, nlohmann/json and GoogleTest headers and the
# generated gRPC code, again in every translation unit. ulysses_precompile_headers(GROUP
# TARGET...) gives the C++ sources of each target (never the CUDA ones) one of the header sets
# below as a precompiled header.
#
# A precompiled header is only valid for sources compiled with the flags it was made with:
# -fPIC (libraries) or -fPIE (executables), -pthread (whatever links gRPC), the sanitizers, and
# every macro defined on the command line. GCC silently skips a header that does not match
# (CMake adds -Winvalid-pch, which says so); clang refuses a macro defined differently, and
# keeps a macro that the header was made with but the source was not. So each set is compiled
# once per group of targets whose flags agree, in a target of its own (ulysses_pch_<group>)
# that links only what every member of the group links: its macros are the group's common
# ones, and a member's own macros (ULYSSES_HAVE_CUDA, the tests' program paths) come on top.
#
# The sets hold only headers that any source of a member may include: the distribution's, and
# in the gRPC groups the project's generated gRPC code (every member links ulysses::proto).
# Including one of them from the header where a source did not adds declarations only.
set(ULYSSES_PCH_CORE
  <algorithm> <atomic> <chrono> <cstdint> <cstring> <functional> <map> <memory> <mutex>
  <optional> <string> <string_view> <thread> <utility> <vector>
  <absl/status/status.h> <absl/status/statusor.h> <absl/strings/str_cat.h>
  <absl/time/clock.h> <absl/time/time.h>
  <spdlog/spdlog.h> <nlohmann/json.hpp>)
# What the gRPC services and clients include, and what protoc's generated code does.
set(ULYSSES_PCH_GRPC
  <grpcpp/grpcpp.h> <grpcpp/client_context.h> <grpcpp/completion_queue.h>
  <grpcpp/generic/async_generic_service.h> <grpcpp/impl/channel_interface.h>
  <grpcpp/impl/client_unary_call.h> <grpcpp/impl/codegen/proto_utils.h>
  <grpcpp/impl/codegen/server_callback_handlers.h> <grpcpp/impl/rpc_method.h>
  <grpcpp/impl/rpc_service_method.h> <grpcpp/impl/service_type.h> <grpcpp/server_context.h>
  <grpcpp/support/async_stream.h> <grpcpp/support/async_unary_call.h>
  <grpcpp/support/client_callback.h> <grpcpp/support/message_allocator.h>
  <grpcpp/support/method_handler.h> <grpcpp/support/server_callback.h>
  <grpcpp/support/stub_options.h> <grpcpp/support/sync_stream.h>
  <google/protobuf/arena.h> <google/protobuf/arenastring.h> <google/protobuf/descriptor.h>
  <google/protobuf/extension_set.h> <google/protobuf/generated_enum_reflection.h>
  <google/protobuf/generated_message_bases.h> <google/protobuf/generated_message_reflection.h>
  <google/protobuf/generated_message_util.h> <google/protobuf/io/coded_stream.h>
  <google/protobuf/message.h> <google/protobuf/metadata_lite.h>
  <google/protobuf/reflection_ops.h> <google/protobuf/repeated_field.h>
  <google/protobuf/unknown_field_set.h> <google/protobuf/wire_format.h>
  <google/protobuf/wire_format_lite.h>)
# The project's generated gRPC code, which most of the gRPC sources include: the groups that
# have it link ulysses::proto, so protoc has written it before the header is compiled.
set(ULYSSES_PCH_PROTO
  [["ulysses/v1/admin.grpc.pb.h"]] [["ulysses/v1/control.grpc.pb.h"]]
  [["ulysses/v1/peer.grpc.pb.h"]] [["ulysses/v1/types.grpc.pb.h"]])
set(ULYSSES_PCH_TEST <gmock/gmock.h> <gtest/gtest.h>)

# The groups: what the members link (and so the flags they share), the header sets, and
# whether they are libraries (-fPIC) or executables (-fPIE).
#   lib_core, exe_core:   the project's code without gRPC;
#   lib_grpc, exe_grpc:   with gRPC and ulysses::proto (and gRPC's -pthread);
#   test_core, test_grpc: the GoogleTest executables, without and with gRPC.
# A group pays where its members have several sources between them: one header costs 5-20 s of
# compile time, and GCC takes 1-2 s to load one where clang takes a fraction of a second.
function(_ulysses_pch_group group out_kind out_links out_headers)
  set(links ulysses_warnings)
  set(headers ${ULYSSES_PCH_CORE})
  if(group MATCHES "_grpc$")
    list(APPEND links ulysses::proto)
    list(APPEND headers ${ULYSSES_PCH_GRPC} ${ULYSSES_PCH_PROTO})
  elseif(NOT group MATCHES "_core$")
    message(FATAL_ERROR "ulysses_precompile_headers: unknown group '${group}'")
  endif()
  set(kind executable)
  if(group MATCHES "^lib_")
    set(kind library)
  elseif(group MATCHES "^test_")
    list(APPEND links GTest::gtest GTest::gmock)
    list(APPEND headers ${ULYSSES_PCH_TEST})
  endif()
  set(${out_kind} ${kind} PARENT_SCOPE)
  set(${out_links} ${links} PARENT_SCOPE)
  set(${out_headers} ${headers} PARENT_SCOPE)
endfunction()

# ulysses_precompile_headers(GROUP TARGET...): the group's precompiled header for each target
# that exists. Every target must link at least what the group does, with the same
# ulysses_warnings (sanitizers); nothing when ULYSSES_PCH is off.
function(ulysses_precompile_headers group)
  if(NOT ULYSSES_PCH)
    return()
  endif()
  set(owner ulysses_pch_${group})
  if(NOT TARGET ${owner})
    _ulysses_pch_group(${group} kind links headers)
    set(source ${PROJECT_BINARY_DIR}/pch/${group}.cc)
    file(CONFIGURE OUTPUT ${source} CONTENT "// The precompiled header of ${owner}.\n")
    add_library(${owner} OBJECT EXCLUDE_FROM_ALL ${source})
    target_link_libraries(${owner} PRIVATE ${links})
    # What ulysses::common gives its users, every member among them; linked, it would make a
    # cycle, as ulysses_common is itself a member.
    foreach(usage COMPILE_DEFINITIONS COMPILE_OPTIONS INCLUDE_DIRECTORIES)
      set_property(TARGET ${owner} APPEND PROPERTY ${usage}
                   "$<TARGET_PROPERTY:ulysses_common,INTERFACE_${usage}>")
    endforeach()
    if(kind STREQUAL "executable")
      # What CMake compiles executables with (-fPIE), where libraries get -fPIC.
      set_target_properties(${owner} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(${owner} PRIVATE ${CMAKE_CXX_COMPILE_OPTIONS_PIE})
    endif()
    set(pch "")
    foreach(header IN LISTS headers)
      string(REPLACE ">" "$<ANGLE-R>" header "${header}")
      list(APPEND pch "$<$<COMPILE_LANGUAGE:CXX>:${header}>")
    endforeach()
    target_precompile_headers(${owner} PRIVATE ${pch})
  endif()
  foreach(target IN LISTS ARGN)
    if(TARGET ${target})
      target_precompile_headers(${target} REUSE_FROM ${owner})
    endif()
  endforeach()
endfunction()
