# Checks of deploy/k8s and deploy/docker (issue #4), included from deploy/CMakeLists.txt when
# DGSERVE_BUILD_TESTS is on. They need kubectl, yamllint (with python3-yaml), node and the npm
# packages of third_party/npm — all installed by tools/setup.sh — and no cluster or Docker engine.

# kustomize builds of the base and both overlays, yamllint, schemas (npm kubernetes-models) and
# cross-references; with the binaries built, every --flag in the manifests against their --help.
add_test(NAME k8s_manifests
  COMMAND bash ${PROJECT_SOURCE_DIR}/deploy/checks/k8s_check.sh --build-dir ${CMAKE_BINARY_DIR})
set_tests_properties(k8s_manifests PROPERTIES LABELS unit TIMEOUT 300)

# The Dockerfile's builder stage installs exactly BUILD_PACKAGES of tools/setup.sh; its runtime
# stage only runtime library packages.
add_test(NAME docker_packages
  COMMAND bash ${PROJECT_SOURCE_DIR}/deploy/checks/docker_packages_check.sh)
set_tests_properties(docker_packages PROPERTIES LABELS unit TIMEOUT 300)

# The runtime stage's packages are exactly those of the shared libraries of the binaries it
# copies (ldd + dpkg -S on this build's binaries); skipped while they are not built.
add_test(NAME docker_runtime_libraries
  COMMAND bash ${PROJECT_SOURCE_DIR}/deploy/checks/docker_packages_check.sh
    --build-dir ${CMAKE_BINARY_DIR})
set_tests_properties(docker_runtime_libraries PROPERTIES LABELS unit TIMEOUT 300
  SKIP_RETURN_CODE 77)
dgserve_test_cost(COST 45 TESTS docker_runtime_libraries)  # 45 s: started first by ctest -j

# Both .dockerignore allowlists hold every source folder the top-level CMakeLists.txt adds.
add_test(NAME docker_context
  COMMAND python3 ${PROJECT_SOURCE_DIR}/deploy/checks/docker_context_check.py)
set_tests_properties(docker_context PROPERTIES LABELS unit TIMEOUT 60)
