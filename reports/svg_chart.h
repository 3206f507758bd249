// Inline SVG charts for the HTML report: no script, no external resource.
// Every chart has a viewBox and no fixed size, so CSS scales it to the page
// width; text stays proportional. Internal to reports/.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddpdiag::reports::svg {

enum class AxisFormat { kNumber, kBytes };

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in order
  bool dashed = false;
};

// A vertical line across the plot at x, labelled (e.g. a recommendation).
struct Marker {
  double x = 0;
  std::string label;
};

struct LineChart {
  std::string title;
  std::string x_label;  // with unit, e.g. "message size (bytes, log scale)"
  std::string y_label;  // with unit, e.g. "bus bandwidth (GB/s)"
  bool log_x = false;
  AxisFormat x_format = AxisFormat::kNumber;
  std::vector<Series> series;
  std::vector<Marker> markers;
};
std::string line_chart(const LineChart& c);

// A square matrix (row = from, column = to); nullopt cells (the diagonal)
// are grey. Highlighted cells get a thick red outline.
struct HeatMap {
  std::string title;
  std::string value_label;  // legend, with unit
  std::vector<std::vector<std::optional<double>>> cells;
  std::vector<std::pair<int, int>> highlighted;
  std::string row_label = "from rank";
  std::string column_label = "to rank";
};
std::string heat_map(const HeatMap& h);

// One bar per entry of bars, split into parts (stacked), values[bar][part].
struct StackedBars {
  std::string title;
  std::string x_label;
  std::string y_label;  // with unit
  std::vector<std::string> bars;
  std::vector<std::string> parts;
  std::vector<std::vector<double>> values;
  double value_scale = 1;  // values are divided by this for display (e.g. 2^20 for MiB)
};
std::string stacked_bars(const StackedBars& b);

// Horizontal spans per lane, e.g. the phases of init per rank.
struct Span {
  std::size_t lane = 0;
  std::string name;
  double start = 0;
  double end = 0;
};
struct Timeline {
  std::string title;
  std::string x_label;  // with unit
  std::vector<std::string> lanes;
  std::vector<Span> spans;
};
std::string timeline(const Timeline& t);

// Colour-blind-safe palette (Okabe and Ito, then Tol), cycled after ten.
const char* palette(std::size_t i);

}  // namespace ddpdiag::reports::svg
