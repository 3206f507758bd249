#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "reports/report.h"

using namespace ddpdiag::reports;
namespace fs = std::filesystem;

TEST_CASE("a report has the schema, world, checks and verdict", "[report]") {
  Report r("allreduce-test", {"ddpdiag", "allreduce-test"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 10, "cpu", "0-1"}, {1, 1, "h", 11, "cpu", "0-1"}},
              {{"gloo", "0.5.0"}});
  r.results()["sizes"] = nlohmann::json::array({1, 2});
  r.add_check({"correctness", CheckStatus::kPass, "0 wrong"});
  auto j = r.finish();
  CHECK(j["schema"] == "ddpdiag.report/1");
  CHECK(j["world"]["size"] == 2);
  CHECK(j["world"]["hosts"].size() == 1);
  CHECK(j["world"]["ranks"][1]["pid"] == 11);
  CHECK(j["checks"][0]["status"] == "pass");
  CHECK(j["verdict"] == "PASS");
  CHECK(j["error"].is_null());
  CHECK(j["duration_s"].is_number());
  r.add_check({"min_busbw", CheckStatus::kFail, "0.1 < 1"});
  CHECK(r.finish()["verdict"] == "FAIL");
  r.set_error({"timeout", "stuck", "allreduce", 1, -1, "check rank 1", 4});
  auto e = r.finish();
  CHECK(e["verdict"] == "ERROR");
  CHECK(e["error"]["rank"] == 1);
  CHECK(e["error"]["peer"].is_null());
}

TEST_CASE("atomic write replaces the file whole and leaves no temporary", "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-report-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto path = (dir / "r.json").string();
  write_json_atomic(path, {{"a", 1}});
  CHECK(read_json(path)["a"] == 1);
  write_json_atomic(path, {{"a", 2}});
  CHECK(read_json(path)["a"] == 2);
  int files = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  CHECK(files == 1);
  fs::remove_all(dir);
}

TEST_CASE("a report written to a link, a pipe or a device goes through it, never replaces it",
          "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-targets-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // A symbolic link (latest.json -> run1.json) keeps pointing at its file,
  // which gets the report.
  const auto target = (dir / "run1.json").string(), link = (dir / "latest.json").string();
  write_json_atomic(target, {{"run", 0}});
  fs::create_symlink("run1.json", link);
  write_json_atomic(link, {{"run", 1}});
  CHECK(fs::is_symlink(link));
  CHECK(read_json(target)["run"] == 1);
  // A FIFO is written through (a reader gets the report) and stays a FIFO.
  const auto fifo = (dir / "pipe").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  std::string got;
  std::thread reader([&] {
    std::ifstream in(fifo);
    got.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  });
  write_json_atomic(fifo, {{"via", "pipe"}});
  reader.join();
  CHECK(fs::is_fifo(fifo));
  CHECK(nlohmann::json::parse(got)["via"] == "pipe");
  // A full device: the write fails with ENOSPC, and the device stays one.
  if (fs::exists("/dev/full")) {
    try {
      write_json_atomic("/dev/full", {{"a", 1}});
      FAIL("writing to /dev/full succeeded");
    } catch (const WriteError& e) {
      CHECK(e.error_number() == ENOSPC);
    }
    CHECK(fs::is_character_file("/dev/full"));
  }
  // No temporary is left anywhere.
  int files = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  CHECK(files == 3);
  CHECK(same_file(link, target));
  CHECK_FALSE(same_file("/dev/null", "/dev/null"));
  CHECK(same_file((dir / "new.json").string(), (dir / "." / "new.json").string()));
  {
    // Relative names of a file not written yet (--json r.json --markdown ./r.json).
    const auto cwd = fs::current_path();
    fs::current_path(dir);
    CHECK(same_file("r.json", "./r.json"));
    CHECK(same_file("r.json", "../" + dir.filename().string() + "/r.json"));
    CHECK_FALSE(same_file("r.json", "r.md"));
    fs::current_path(cwd);
  }
  CHECK(output_path_problem((dir / "missing" / "r.json").string()).has_value());
  CHECK(output_path_problem(dir.string()).has_value());
  CHECK_FALSE(output_path_problem((dir / "new.json").string()).has_value());
  fs::remove_all(dir);
}

TEST_CASE("a writer killed mid-write leaves the old file intact", "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-kill-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto path = (dir / "r.json").string();
  write_json_atomic(path, {{"generation", "old"}});
  // A child writes a large report over and over; it is killed at some point in
  // the middle. Whatever moment the kill lands, the file parses and is either
  // the old report or a complete new one.
  std::string big(8 << 20, 'x');
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    for (;;) write_json_atomic(path, {{"generation", "new"}, {"payload", big}});
  }
  usleep(150 * 1000);
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  auto j = read_json(path);
  CHECK((j["generation"] == "old" || (j["generation"] == "new" && j["payload"].get<std::string>().size() == big.size())));
  fs::remove_all(dir);
}

TEST_CASE("a report of the longest name a directory allows is written and leaves no temporary", "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-longname-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // 250 bytes: a valid name, which a temporary of FILE plus a suffix is not.
  const auto path = (dir / (std::string(245, 'r') + ".json")).string();
  CHECK_FALSE(output_path_problem(path).has_value());
  write_json_atomic(path, {{"a", 1}});
  CHECK(read_json(path)["a"] == 1);
  write_json_atomic(path, {{"a", 2}});  // replacing it too
  CHECK(read_json(path)["a"] == 2);
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{fs::path(path).filename().string()});
  // A bare name, relative to the working directory, too.
  const auto cwd = fs::current_path();
  fs::current_path(dir);
  write_json_atomic("short.json", {{"b", 1}});
  CHECK_FALSE(output_path_problem("short.json").has_value());
  fs::current_path(cwd);
  CHECK(read_json((dir / "short.json").string())["b"] == 1);
  int files = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  CHECK(files == 2);
  fs::remove_all(dir);
}

TEST_CASE("a report replaced keeps the file's permissions", "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-mode-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto path = (dir / "private.json").string();
  write_json_atomic(path, {{"a", 1}});
  REQUIRE(::chmod(path.c_str(), 0600) == 0);
  write_json_atomic(path, {{"a", 2}});
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0600);
  CHECK(read_json(path)["a"] == 2);
  fs::remove_all(dir);
}

TEST_CASE("a report whose JSON cannot be held is refused naming the file", "[report]") {
  auto dir = fs::temp_directory_path() / ("ddpdiag-huge-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto path = (dir / "huge.json").string();
  {
    std::ofstream(path) << R"({"schema": "ddpdiag.report/1", "duration_s": 1e400})";
  }
  try {
    read_json(path);
    FAIL("1e400 was read");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  fs::remove_all(dir);
}
