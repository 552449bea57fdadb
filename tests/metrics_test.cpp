// troupe::metrics_text and serve_metrics (docs/api.md, "Watching it run"): the numbers of the
// process's runners in the Prometheus text format, with bounded series (no job in a label),
// accepted by promtool, served over HTTP.
#include "metrics_parts.hpp"

namespace {

TEST(Metrics, TheTextHasTheRunnersNumbersAndItsSeriesDoNotGrowWithTheJobs) {
  troupe::unordered_runner<test_jobs::squares> runner{2};
  EXPECT_EQ(runner.run(test_util::iota(1000)), test_util::sum_of_squares(1000));
  auto text = troupe::metrics_text();
  auto id = runner_label(text);
  ASSERT_FALSE(id.empty()) << text;
  auto r = "{runner=\"" + id + "\"}";
  EXPECT_EQ(sample(text, "troupe_items_consumed_total" + r), 1000) << text;
  EXPECT_EQ(sample(text, "troupe_jobs_submitted_total" + r), 1);
  EXPECT_EQ(
      sample(text, "troupe_jobs_completed_total{outcome=\"succeeded\",runner=\"" + id + "\"}"), 1);
  EXPECT_EQ(sample(text, "troupe_jobs_running" + r), 0);
  EXPECT_EQ(sample(text, "troupe_queued_items" + r), 0);
  EXPECT_EQ(sample(text, "troupe_producers{runner=\"" + id + "\",state=\"up\"}"), 2);
  auto items0 = sample(
      text, "troupe_producer_items_total{device=\"cpu\",producer=\"0\",runner=\"" + id + "\"}");
  auto items1 = sample(
      text, "troupe_producer_items_total{device=\"cpu\",producer=\"1\",runner=\"" + id + "\"}");
  EXPECT_EQ(items0 + items1, 1000);
  EXPECT_NE(text.find("# TYPE troupe_producer_busy_seconds_total counter"), std::string::npos);
  EXPECT_EQ(sample(text, "troupe_build_info{version=\"0.1.0\"}"), 1);
  EXPECT_GT(sample(text, "process_resident_memory_bytes"), 0);
  EXPECT_GT(sample(text, "process_open_fds"), 0);
  // 1,000 more jobs: more in the counters, not one more series.
  for (int i = 0; i < 1000; ++i) runner.run(test_util::iota(3));
  auto after = troupe::metrics_text();
  EXPECT_EQ(series_of(after), series_of(text)) << "a label took a job";
  EXPECT_EQ(sample(after, "troupe_jobs_submitted_total" + r), 1001);
  EXPECT_EQ(sample(after, "troupe_items_consumed_total" + r), 4000);
  // Histograms: one job-time observation per job ended, one chunk-time observation per chunk.
  EXPECT_EQ(sample(after, "troupe_job_seconds_count" + r), 1001);
  EXPECT_EQ(sample(after, "troupe_job_seconds_bucket{runner=\"" + id + "\",le=\"+Inf\"}"), 1001);
  EXPECT_GE(sample(after, "troupe_chunk_seconds_count" + r), 1001);
  // Queue wait: one observation per chunk's first send; every answer was sent before.
  auto first = sample(after, "troupe_chunks_sent_total{attempt=\"first\",runner=\"" + id + "\"}");
  auto again = sample(after, "troupe_chunks_sent_total{attempt=\"again\",runner=\"" + id + "\"}");
  EXPECT_GE(first, 1001);
  EXPECT_GE(again, 0);
  EXPECT_EQ(sample(after, "troupe_queue_wait_seconds_count" + r), first);
  EXPECT_GE(first + again, sample(after, "troupe_chunk_seconds_count" + r));
  EXPECT_GT(sample(after, "troupe_last_item_timestamp_seconds" + r), 1.7e9);  // a unix time
  EXPECT_EQ(sample(after, "troupe_late_answers_total" + r), 0);
  // Every name: troupe_ or process_, and counters end in _total.
  for (auto& s : series_of(after)) {
    auto name = s.substr(0, s.find('{'));
    EXPECT_TRUE(name.rfind("troupe_", 0) == 0 || name.rfind("process_", 0) == 0) << name;
  }
}

TEST(Metrics, PromtoolAcceptsTheText) {
#ifndef TROUPE_PROMTOOL
  GTEST_SKIP() << "promtool was not found when this was configured (tools/setup.sh unpacks "
                  "Debian's prometheus package's promtool into /opt/troupe-promtool)";
#else
  troupe::unordered_runner<test_jobs::squares> runner{2};
  runner.run(test_util::iota(100));
  int rc = -1;
  auto said = promtool_says(troupe::metrics_text(), rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "") << "promtool's lint complained";
#endif
}

TEST(Metrics, RetriesAndSkippedItemsAgreeWithTheJobsReports) {
  troupe::unordered_runner<test_jobs::throws_on_item> runner{2};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(2).then_skip();
  auto h = runner.submit(test_util::iota(100), o);
  h.get();
  auto report = h.report();
  ASSERT_EQ(report.failures.size(), 1u) << "item 42 fails every attempt";
  auto text = troupe::metrics_text();
  auto r = "{runner=\"" + runner_label(text) + "\"}";
  EXPECT_EQ(sample(text, "troupe_retries_total" + r), static_cast<double>(report.retries));
  EXPECT_EQ(report.retries, 2u);
  EXPECT_EQ(sample(text, "troupe_skipped_items_total" + r), 1);
}

TEST(Metrics, ScrapedDuringARunPromtoolAcceptsItAndAfterItTheCountersAreTheRunnersStats) {
  held_runner held;
  auto& runner = held.runner;
  auto h = runner.submit(test_util::iota(10));
  // During: a job is running (item 4 held), and the text is valid.
  while (runner.stats().items < 4) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  auto during = troupe::metrics_text();
  EXPECT_FALSE(h.done());
  auto id = runner_label(during);
  ASSERT_FALSE(id.empty()) << during;
  auto r = "{runner=\"" + id + "\"}";
  EXPECT_EQ(sample(during, "troupe_jobs_running" + r), 1);
  int rc = -1;
  auto said = promtool_says(during, rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "") << "promtool's lint complained about a text taken during a run";
  held.release.open();
  EXPECT_EQ(h.get(), test_util::sum_of_squares(10));
  // After: each counter is what stats() says.
  auto after = troupe::metrics_text();
  auto s = runner.stats();
  EXPECT_EQ(sample(after, "troupe_items_consumed_total" + r), static_cast<double>(s.items));
  EXPECT_EQ(
      sample(after, "troupe_jobs_completed_total{outcome=\"succeeded\",runner=\"" + id + "\"}"),
      static_cast<double>(s.runs - s.failed_runs));
  EXPECT_EQ(sample(after, "troupe_duplicated_items_total" + r),
            static_cast<double>(s.duplicated_items));
  EXPECT_EQ(sample(after, "troupe_late_answers_total" + r), static_cast<double>(s.late_answers));
  ASSERT_EQ(s.producers.size(), 1u);
  EXPECT_EQ(sample(after, "troupe_producer_items_total{device=\"cpu\",producer=\"0\",runner=\"" +
                              id + "\"}"),
            static_cast<double>(s.producers[0].items));
  EXPECT_EQ(sample(after, "troupe_jobs_running" + r), 0);
  said = promtool_says(after, rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "");
}

}  // namespace
