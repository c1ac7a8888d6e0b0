# tests/unit/engine.cmake: unit tests of the training engine (kernels, model,
# optimizer, data, spec).
zt_unit_test(engine_kernels SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_kernels.c
             LIBS zt_kernels_cpu)
zt_unit_test(engine_model SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_model.c LIBS zt_trainer)
zt_unit_test(engine_optim SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_optim.c LIBS zt_trainer)
zt_unit_test(engine_data SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_data.c LIBS zt_trainer)
zt_unit_test(engine_spec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_spec.c LIBS zt_trainer)
