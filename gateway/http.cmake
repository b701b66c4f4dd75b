# The OpenAI-compatible HTTP front end of the gateway (included from gateway/CMakeLists.txt).
dgserve_cc_library(NAME dgserve_openai_api
  SRCS ${CMAKE_CURRENT_LIST_DIR}/openai_api_parse.cc ${CMAKE_CURRENT_LIST_DIR}/openai_api_format.cc
    ${CMAKE_CURRENT_LIST_DIR}/json_fields.cc
  DEPS dgserve_common dgserve_proto dgserve_status_convert dgserve_tokenizer nlohmann_json::nlohmann_json
       absl::flat_hash_set absl::cord absl::status absl::statusor absl::strings)

dgserve_cc_library(NAME dgserve_http_server
  SRCS ${CMAKE_CURRENT_LIST_DIR}/http_server.cc ${CMAKE_CURRENT_LIST_DIR}/http_connection.cc
  DEPS dgserve_openai_api dgserve_status_convert dgserve_common Boost::headers prometheus-cpp::core
       absl::status absl::statusor absl::strings absl::time absl::synchronization Threads::Threads)

if(DGSERVE_BUILD_TESTS)
  # dgserve_cc_test, plus TEST_PREFIX "<name>." so that the ctest names carry the target name
  # (gtest_discover_tests otherwise names tests Suite.Case only, and
  # `ctest -R 'openai|json_fields'` would find none of them).
  function(dgserve_http_cc_test)
    cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
    dgserve_cc_test(NAME ${A_NAME} SRCS ${A_SRCS} DEPS ${A_DEPS} LABELS ${A_LABELS}
      TEST_PREFIX "${A_NAME}.")
    target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  endfunction()
  dgserve_http_cc_test(NAME openai_api_test
    SRCS ${CMAKE_CURRENT_LIST_DIR}/openai_api_parse_test.cc
      ${CMAKE_CURRENT_LIST_DIR}/openai_api_format_test.cc
    DEPS dgserve_openai_api LABELS unit)
  dgserve_http_cc_test(NAME json_fields_test
    SRCS ${CMAKE_CURRENT_LIST_DIR}/json_fields_test.cc
    DEPS dgserve_openai_api LABELS unit)
  dgserve_http_cc_test(NAME openai_http_server_test
    SRCS ${CMAKE_CURRENT_LIST_DIR}/http_server_test.cc
      ${CMAKE_CURRENT_LIST_DIR}/http_server_stream_test.cc
    DEPS dgserve_http_server dgserve_admission dgserve_http_client LABELS unit)
  dgserve_http_cc_test(NAME openai_http_connection_test
    SRCS ${CMAKE_CURRENT_LIST_DIR}/http_server_connection_test.cc
    DEPS dgserve_http_server dgserve_admission dgserve_http_client LABELS unit)
endif()
