# Checks of the observability artifacts (deploy/grafana, deploy/prometheus); included by
# deploy/CMakeLists.txt when DGSERVE_BUILD_TESTS is on. See deploy/grafana/README.md and
# deploy/prometheus/README.md.
#   obs_static (unit): tsc type check of the dashboard against @grafana/schema, dashboard.json
#     up to date, dashboard lint, PromQL of every query, promtool check config / check rules /
#     test rules.
#   obs_live (e2e): a real local cluster and Prometheus server: every metric the dashboard and
#     the alert rules read is exported, every dashboard query returns series.
add_test(NAME obs_static
  COMMAND bash ${PROJECT_SOURCE_DIR}/deploy/checks/obs_static.sh)
set_tests_properties(obs_static PROPERTIES LABELS unit TIMEOUT 300)

add_test(NAME obs_live
  COMMAND bash ${PROJECT_SOURCE_DIR}/deploy/checks/obs_live.sh --build ${CMAKE_BINARY_DIR})
set_tests_properties(obs_live PROPERTIES LABELS e2e TIMEOUT 300)
