# tools/ztrain.cmake: the local launcher (zcoord + N zworkers for one job).
add_executable(ztrain ${CMAKE_CURRENT_SOURCE_DIR}/ztrain.c)
target_link_libraries(ztrain PRIVATE zt_common zt_rpc zt_proto)
