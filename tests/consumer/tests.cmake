# Registers the consumer test (label cpu): the installed package is usable from another project.
add_test(NAME consumer_find_package
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DSOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}
                 -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer -DGENERATOR=${CMAKE_GENERATOR}
                 -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
set_tests_properties(consumer_find_package PROPERTIES LABELS cpu TIMEOUT 600)
