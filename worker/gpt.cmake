# worker/gpt.cmake: the training engine: the CPU model (GPT-2 over CBLAS +
# OpenMP), token shards, the job spec, checkpoint files and the ZeRO
# data-parallel trainer.
add_library(zt_gpt STATIC ${CMAKE_CURRENT_SOURCE_DIR}/gpt.c)
target_include_directories(zt_gpt PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(zt_gpt PRIVATE -O3)
target_link_libraries(zt_gpt PUBLIC zt_common OpenMP::OpenMP_C PkgConfig::OPENBLAS m)

# The job spec parser alone: zcoord validates submitted specs with it.
add_library(zt_jspec STATIC ${CMAKE_CURRENT_SOURCE_DIR}/jspec.c ${CMAKE_CURRENT_SOURCE_DIR}/shards.c)
target_include_directories(zt_jspec PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_jspec PUBLIC zt_common PkgConfig::CJSON m)

add_library(zt_engine STATIC ${CMAKE_CURRENT_SOURCE_DIR}/ckpt_io.c ${CMAKE_CURRENT_SOURCE_DIR}/dist.c)
target_include_directories(zt_engine PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(zt_engine PRIVATE -O3)
target_link_libraries(zt_engine PUBLIC zt_jspec zt_gpt zt_comm zt_proto PkgConfig::CJSON PkgConfig::XXHASH
                      OpenMP::OpenMP_C)
