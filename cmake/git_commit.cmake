# Writes OUT, a header defining ULYSSES_GIT_COMMIT as the source tree's commit (12 hex digits,
# "-dirty" when tracked files differ from it; "unknown" outside a git checkout). Run at every
# build (bench/CMakeLists.txt), it rewrites OUT only when the text changes, so what records the
# commit is rebuilt only then.
# A tree unpacked inside another checkout is not that checkout's commit.
execute_process(COMMAND git rev-parse --show-toplevel
                WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE top OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE rc ERROR_QUIET)
if(rc EQUAL 0)
  get_filename_component(top "${top}" REALPATH)
  get_filename_component(src "${SRC}" REALPATH)
  if(NOT top STREQUAL src)
    set(rc 1)
  endif()
endif()
if(rc EQUAL 0)
  execute_process(COMMAND git rev-parse --short=12 HEAD
                  WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc ERROR_QUIET)
endif()
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
else()
  # No optional locks: a build beside a running git command takes no index lock.
  execute_process(COMMAND git --no-optional-locks status --porcelain --untracked-files=no
                  WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT changes STREQUAL "")
    string(APPEND commit "-dirty")
  endif()
endif()
set(text "#define ULYSSES_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL text)
  file(WRITE ${OUT} "${text}")
endif()
