# Abseil-style helpers: one static library per component, tests registered with ctest labels.
#
# dgserve_cc_library(NAME n SRCS ... [HDRS ...] [DEPS ...])
# dgserve_cc_test(NAME n SRCS ... [DEPS ...] [LABELS unit] [ENV K=V ...] [TEST_PREFIX p.])
#   Built at -O1 in Release (dgserve_test_optimization).
#   TEST_PREFIX: prepended to every discovered test name (a test file built twice, as the
#   gpu-emu copies of the gpu tests, must not register the same names twice).

function(dgserve_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS} ${A_HDRS})
  target_include_directories(${A_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()

# A test's own translation units at -O1 in Release builds (the code under test, in the libraries
# it links, keeps the build type's -O3): about 30 % less compile time per test file (cluster_test
# 21 → 14 s, quant_nvfp4_test 16 → 12 s, http_server_test 14.5 → 10.5 s of CPU), for test code
# that runs little (issue 35: CI inside its time).
# DGSERVE_TEST_OPT_FLAGS, when set, replaces that choice in every build type: the sanitizer tree
# (tools/configure_sanitize.sh) compiles test code at -O0.
set(DGSERVE_TEST_OPT_FLAGS "" CACHE STRING
  "Optimisation flags for tests' own translation units (empty: -O1 in Release)")
function(dgserve_test_optimization target)
  if(DGSERVE_TEST_OPT_FLAGS)
    target_compile_options(${target} PRIVATE ${DGSERVE_TEST_OPT_FLAGS})
  else()
    target_compile_options(${target} PRIVATE $<$<CONFIG:Release>:-O1>)
  endif()
endfunction()

# dgserve_test_cost(COST n TESTS name...): marks tests that run long (seconds on 2 cores: under
# ASan + UBSan for the tests tools/sanitize.sh runs too) so that `ctest -j` starts them first. In a
# fresh build directory ctest has no timings yet (Testing/Temporary/CTestCostData.txt) and starts
# tests in declaration order, so a three-minute test that comes last ran alone at the end of a
# two-core run. Names may be whole-binary tests (add_test) or single GoogleTest tests found by
# gtest_discover_tests; call it after the test is declared, in the same directory.
function(dgserve_test_cost)
  cmake_parse_arguments(A "" "COST" "TESTS" ${ARGN})
  # Discovered tests exist only when ctest runs the discovery's include file: set the property
  # from an include file added after it. (A directory's include files run before its add_test
  # lines, so tests declared with add_test get the property here.)
  set(_text "")
  foreach(_t ${A_TESTS})
    if(TEST "${_t}")
      set_tests_properties("${_t}" PROPERTIES COST ${A_COST})
    else()
      string(APPEND _text "set_tests_properties([=[${_t}]=] PROPERTIES COST ${A_COST})\n")
    endif()
  endforeach()
  if(_text)
    string(MD5 _id "${A_TESTS}")
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/dgserve_test_cost_${_id}.cmake")
    file(WRITE "${_file}" "${_text}")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${_file}")
  endif()
endfunction()

function(dgserve_cc_test)
  cmake_parse_arguments(A "" "NAME;TEST_PREFIX" "SRCS;DEPS;LABELS;ENV" ${ARGN})
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_include_directories(${A_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  dgserve_test_optimization(${A_NAME})
  gtest_discover_tests(${A_NAME} TEST_PREFIX "${A_TEST_PREFIX}"
    PROPERTIES LABELS "${A_LABELS}" ENVIRONMENT "DGSERVE_SOURCE_DIR=${PROJECT_SOURCE_DIR};OMP_WAIT_POLICY=passive;${A_ENV}"
    DISCOVERY_TIMEOUT 60)
endfunction()

# dgserve_cli_refusal_tests(PREFIX p COMMAND "shell text" [THEN "shell test"] [EXPECT regex]
#                           [FIXTURE f] CASES "name|args|message regex" ...)
# One `unit` test per case, named p<name>: runs COMMAND with @NAME@ and @ARGS@ replaced by the
# case's, and passes when it exits 1 (and THEN, with @NAME@ replaced, holds) and its output
# matches EXPECT followed by the case's message regex. For command-line tools' bad-input checks.
function(dgserve_cli_refusal_tests)
  cmake_parse_arguments(A "" "PREFIX;COMMAND;THEN;EXPECT;FIXTURE" "CASES" ${ARGN})
  foreach(_case ${A_CASES})
    string(REPLACE "|" ";" _parts "${_case}")
    list(GET _parts 0 _name)
    list(GET _parts 1 _args)
    list(GET _parts 2 _want)
    string(REPLACE "@NAME@" "${_name}" _cmd "${A_COMMAND}")
    string(REPLACE "@ARGS@" "${_args}" _cmd "${_cmd}")
    set(_then "")
    if(A_THEN)
      string(REPLACE "@NAME@" "${_name}" _then " && ${A_THEN}")
    endif()
    add_test(NAME ${A_PREFIX}${_name}
      COMMAND sh -c "${_cmd} 2>&1; test $? -eq 1${_then} && echo exit-1")
    set_tests_properties(${A_PREFIX}${_name} PROPERTIES LABELS unit
      PASS_REGULAR_EXPRESSION "${A_EXPECT}${_want}.*\nexit-1")
    if(A_FIXTURE)
      set_tests_properties(${A_PREFIX}${_name} PROPERTIES FIXTURES_REQUIRED ${A_FIXTURE})
    endif()
  endforeach()
endfunction()
