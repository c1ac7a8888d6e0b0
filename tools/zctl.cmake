# tools/zctl.cmake: the operator CLI.
add_executable(zctl ${CMAKE_CURRENT_SOURCE_DIR}/zctl.c)
target_link_libraries(zctl PRIVATE zt_common zt_rpc zt_proto PkgConfig::CJSON)
