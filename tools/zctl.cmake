# tools/zctl.cmake: the operator CLI.
add_executable(zctl ${CMAKE_CURRENT_SOURCE_DIR}/zctl.c ${CMAKE_CURRENT_SOURCE_DIR}/export.c)
target_include_directories(zctl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zctl PRIVATE zt_engine zt_pbcall zt_pbjson zt_common zt_rpc zt_proto PkgConfig::CJSON)
