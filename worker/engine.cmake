# worker/engine.cmake: the training engine (model, optimizer helpers, data,
# spec) as the library zt_trainer, and zsolo, single-process training from a
# spec through the distributed trainer (dist.cmake) on one rank.
add_library(zt_trainer STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/model.c
  ${CMAKE_CURRENT_SOURCE_DIR}/optim.c
  ${CMAKE_CURRENT_SOURCE_DIR}/data.c
  ${CMAKE_CURRENT_SOURCE_DIR}/spec.c)
target_include_directories(zt_trainer PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_trainer PUBLIC zt_kernels_cpu zt_common PkgConfig::CJSON m)

if(NOT ZT_GPU_ONLY)
  add_executable(zsolo ${CMAKE_CURRENT_SOURCE_DIR}/solo.c)
  target_link_libraries(zsolo PRIVATE zt_engine)
endif()
