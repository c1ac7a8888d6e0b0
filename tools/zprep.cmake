# tools/zprep.cmake: zprep, text -> token shards (byte-level or GPT-2 BPE).
add_executable(zprep ${CMAKE_CURRENT_SOURCE_DIR}/zprep.c)
target_link_libraries(zprep PRIVATE zt_common PkgConfig::CJSON m)
