# worker/dist.cmake: the distributed trainer (ZeRO 0-3 over worker/comm) and
# the checkpoint files, on top of the engine library zt_trainer.
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_library(zt_engine STATIC ${CMAKE_CURRENT_SOURCE_DIR}/ckpt_io.c ${CMAKE_CURRENT_SOURCE_DIR}/dist.c
            ${CMAKE_CURRENT_SOURCE_DIR}/gpu.c)
target_include_directories(zt_engine PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(zt_engine PRIVATE -O3)
target_link_libraries(zt_engine PUBLIC zt_trainer zt_comm zt_proto PkgConfig::CJSON PkgConfig::XXHASH
                      OpenMP::OpenMP_C ${CMAKE_DL_LIBS})
