zt_unit_test(test_spike SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_spike.c
             ${CMAKE_SOURCE_DIR}/coordinator/spike.c)
target_include_directories(test_spike PRIVATE ${CMAKE_SOURCE_DIR}/coordinator)
target_link_libraries(test_spike PRIVATE m)
