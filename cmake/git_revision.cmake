# Writes the git revision of the source tree into a generated C++ source, at
# build time: the top CMakeLists.txt runs it on every build (the custom target
# ddpdiag_git_revision_check) as
#   cmake -DSOURCE_DIR=... -DGIT_EXECUTABLE=... -DTEMPLATE=... -DOUTPUT=... -P git_revision.cmake
# The revision is `git rev-parse --short=12 HEAD`, with "-dirty" appended when
# tracked files differ from HEAD (staged or not; untracked files do not
# count), or "unknown" without git or outside a git checkout (a source
# tarball). OUTPUT is rewritten only when its text changes (configure_file),
# so an unchanged revision recompiles and relinks nothing. This script never
# fails the build over git.
cmake_minimum_required(VERSION 3.25)

set(revision "unknown")
# Only the source tree's own checkout (.git: a directory, or a file in a
# worktree or submodule): a tarball unpacked inside another repository must
# not take that repository's revision.
if(GIT_EXECUTABLE AND EXISTS "${SOURCE_DIR}/.git")
  execute_process(COMMAND "${GIT_EXECUTABLE}" rev-parse --short=12 HEAD
    WORKING_DIRECTORY "${SOURCE_DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE head
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(rc EQUAL 0 AND head MATCHES "^[0-9a-f]+$")
    set(revision "${head}")
    # --no-optional-locks: no index refresh written back, so a build never
    # holds .git/index.lock while someone commits in the same tree.
    execute_process(COMMAND "${GIT_EXECUTABLE}" --no-optional-locks status --porcelain
                            --untracked-files=no
      WORKING_DIRECTORY "${SOURCE_DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE changes
      ERROR_QUIET)
    if(NOT rc EQUAL 0)
      message(STATUS "ddpdiag: `git status` failed in ${SOURCE_DIR}: revision ${revision} not checked for local changes")
    elseif(NOT changes STREQUAL "")
      string(APPEND revision "-dirty")
    endif()
  endif()
endif()

set(DDPDIAG_GIT_REVISION "${revision}")
configure_file("${TEMPLATE}" "${OUTPUT}" @ONLY)
