#include "reports/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/core.h>

#include "reports/format.h"

namespace ddpdiag::reports::svg {

namespace {

// Drawing units of the viewBox. The page scales the whole picture, so these
// are proportions, not pixels; 600 wide keeps 13-unit text legible when a
// phone shrinks the chart to about 360 px.
constexpr double kWidth = 600;
constexpr double kLeft = 70, kRight = 18, kTop = 38, kPlotHeight = 250, kBottom = 52;
constexpr double kLegendRow = 20;
constexpr int kLegendColumns = 2;
constexpr std::size_t kPaletteSize = 10;  // palette()'s colours

std::string esc(const std::string& s) { return html_escape(s); }

std::string num(double v) { return fmt::format("{:.1f}", v); }

std::string open_svg(double height, const std::string& title) {
  return fmt::format(
      "<svg class=\"chart\" viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"{}\" "
      "xmlns=\"http://www.w3.org/2000/svg\" font-family=\"system-ui, sans-serif\" font-size=\"13\">"
      "<title>{}</title><rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>"
      "<text class=\"title\" x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"600\">{}</text>",
      num(kWidth), num(height), esc(title), esc(title), esc(title));
}

// Linear ticks at 1, 2 or 5 times a power of ten. Widens [lo, hi] to whole
// steps. No ticks where the range has no usable step: a bound or the step not
// finite (a figure near DBL_MAX), or the step below lo's precision (lo + step
// == lo, e.g. 25 and 25.000000000000004); at most kMaxTicks in any case.
constexpr int kMaxTicks = 50;
std::vector<double> nice_ticks(double& lo, double& hi, int want = 5) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || want < 1) return {};
  if (!(hi > lo)) {
    double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  double raw = (hi - lo) / want;
  if (!std::isfinite(raw) || !(raw > 0)) return {};
  double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  const double nlo = std::floor(lo / step) * step, nhi = std::ceil(hi / step) * step;
  if (!std::isfinite(step) || !(step > 0) || !std::isfinite(nlo) || !std::isfinite(nhi) || nlo + step == nlo ||
      nhi - step == nhi)
    return {};
  const double count = std::round((nhi - nlo) / step);
  if (!std::isfinite(count) || count < 0 || count > kMaxTicks) return {};
  lo = nlo;
  hi = nhi;
  std::vector<double> t;
  for (int i = 0; i <= static_cast<int>(count); ++i) {
    const double v = lo + i * step;
    t.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  }
  return t;
}

// Log ticks: powers of two for bytes (at most ~8 labels), 1-2-5 otherwise.
std::vector<double> log_ticks(double lo, double hi, AxisFormat f) {
  std::vector<double> t;
  if (!std::isfinite(lo) || !std::isfinite(hi) || !(lo > 0) || !(hi >= lo)) return t;
  if (f == AxisFormat::kBytes) {
    int e0 = static_cast<int>(std::ceil(std::log2(lo) - 1e-9)), e1 = static_cast<int>(std::floor(std::log2(hi) + 1e-9));
    int stride = std::max(1, (e1 - e0 + 8) / 8);
    for (int e = e0; e <= e1; e += stride) t.push_back(std::ldexp(1.0, e));
  } else {
    int d0 = static_cast<int>(std::floor(std::log10(lo))), d1 = static_cast<int>(std::ceil(std::log10(hi)));
    for (int d = d0; d <= d1; ++d)
      for (double m : {1.0, 2.0, 5.0}) {
        double v = m * std::pow(10, d);
        if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) t.push_back(v);
      }
    if (t.size() > 10) {
      std::vector<double> only_ones;
      for (double v : t)
        if (std::fabs(std::log10(v) - std::round(std::log10(v))) < 1e-9) only_ones.push_back(v);
      t = only_ones;
    }
  }
  return t;
}

std::string tick_label(double v, AxisFormat f) {
  return f == AxisFormat::kBytes ? short_bytes(v) : format_figure(v, 3);
}

// A line's dash pattern: solid, or dashed (in-place); past the palette's
// ten colours, dash-dot and dotted, so that no two lines look alike.
std::string dash_attr(std::size_t i, bool dashed) {
  if ((i / kPaletteSize) % 2 == 0) return dashed ? " stroke-dasharray=\"5 3\"" : "";
  return dashed ? " stroke-dasharray=\"2 2\"" : " stroke-dasharray=\"10 3 2 3\"";
}

// Legend under the plot: swatch and name, kLegendColumns to a row.
std::string legend(const std::vector<std::string>& names, const std::vector<bool>& dashed, double y0,
                   bool lines) {
  std::string out;
  const double col = (kWidth - 2 * 10) / kLegendColumns;
  for (std::size_t i = 0; i < names.size(); ++i) {
    double x = 10 + col * static_cast<double>(i % kLegendColumns);
    double y = y0 + kLegendRow * static_cast<double>(i / kLegendColumns);
    if (lines)
      out += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2.5\"{}/>",
                         num(x), num(y - 4), num(x + 22), num(y - 4), palette(i),
                         dash_attr(i, i < dashed.size() && dashed[i]));
    else
      out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"12\" fill=\"{}\"/>", num(x + 4),
                         num(y - 11), palette(i));
    out += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>", num(x + 28), num(y), esc(names[i]));
  }
  return out;
}

double legend_height(std::size_t n) {
  return kLegendRow * static_cast<double>((n + kLegendColumns - 1) / kLegendColumns) + 8;
}

std::string no_data(double y) {
  return fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#777\">no data</text>",
                     num(kWidth / 2), num(y));
}

// Axes frame, grid, tick labels and axis titles around the plot area.
struct Frame {
  double x0 = kLeft, x1 = kWidth - kRight, y0 = kTop, y1 = kTop + kPlotHeight;
};

std::string y_axis(const Frame& f, const std::vector<double>& ticks, double lo, double hi,
                   const std::string& label) {
  std::string out;
  for (double t : ticks) {
    double y = f.y1 - (t - lo) / (hi - lo) * (f.y1 - f.y0);
    out += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#e3e3e3\"/>", num(f.x0), num(y),
                       num(f.x1), num(y));
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>", num(f.x0 - 6), num(y + 4),
                       esc(format_figure(t, 3)));
  }
  out += fmt::format(
      "<text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
      num((f.y0 + f.y1) / 2), esc(label));
  out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>",
                     num(f.x0), num(f.y0), num(f.x1 - f.x0), num(f.y1 - f.y0));
  return out;
}

std::string x_title(const Frame& f, const std::string& label) {
  return fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", num((f.x0 + f.x1) / 2),
                     num(f.y1 + 40), esc(label));
}

}  // namespace

const char* palette(std::size_t i) {
  // Okabe-Ito first, then Tol's muted colours, so ten series stay distinct.
  static const char* colors[kPaletteSize] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                                             "#56B4E9", "#882255", "#44AA99", "#999933", "#000000"};
  return colors[i % kPaletteSize];
}

std::string line_chart(const LineChart& c) {
  std::vector<std::string> names;
  std::vector<bool> dashed;
  for (const auto& s : c.series) {
    names.push_back(s.name);
    dashed.push_back(s.dashed);
  }
  const double height = kTop + kPlotHeight + kBottom + legend_height(names.size());
  std::string out = open_svg(height, c.title);
  Frame f;

  double xlo = INFINITY, xhi = -INFINITY, yhi = -INFINITY, ylo = INFINITY;
  for (const auto& s : c.series)
    for (auto [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y) || (c.log_x && x <= 0)) continue;
      xlo = std::min(xlo, x);
      xhi = std::max(xhi, x);
      ylo = std::min(ylo, y);
      yhi = std::max(yhi, y);
    }
  for (const auto& m : c.markers)
    if (std::isfinite(m.x) && (!c.log_x || m.x > 0)) {
      xlo = std::min(xlo, m.x);
      xhi = std::max(xhi, m.x);
    }
  if (!std::isfinite(xlo) || !std::isfinite(ylo)) {
    out += y_axis(f, {}, 0, 1, c.y_label) + x_title(f, c.x_label) + no_data((f.y0 + f.y1) / 2) + "</svg>";
    return out;
  }
  // Quantities charted here are sizes, rates and times: the y axis starts at 0.
  ylo = std::min(0.0, ylo);
  // Headroom above the highest point, kept finite (a figure near DBL_MAX).
  yhi = yhi <= ylo ? ylo + 1 : std::min(yhi * 1.05, std::numeric_limits<double>::max());
  auto yt = nice_ticks(ylo, yhi);
  std::vector<double> xt;
  if (c.log_x) {
    if (xhi <= xlo) {
      xlo /= 2;
      xhi = std::min(xhi * 2, std::numeric_limits<double>::max());
    }
    xt = log_ticks(xlo, xhi, c.x_format);
  } else {
    xt = nice_ticks(xlo, xhi, 6);
  }
  auto px = [&](double x) {
    double t = c.log_x ? (std::log(x) - std::log(xlo)) / (std::log(xhi) - std::log(xlo)) : (x - xlo) / (xhi - xlo);
    return f.x0 + 8 + t * (f.x1 - f.x0 - 16);
  };
  auto py = [&](double y) { return f.y1 - (y - ylo) / (yhi - ylo) * (f.y1 - f.y0); };

  out += y_axis(f, yt, ylo, yhi, c.y_label);
  for (double t : xt) {
    double x = px(t);
    out += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#eee\"/>", num(x), num(f.y0), num(x),
                       num(f.y1));
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", num(x), num(f.y1 + 18),
                       esc(tick_label(t, c.x_format)));
  }
  out += x_title(f, c.x_label);

  for (std::size_t i = 0; i < c.series.size(); ++i) {
    const auto& s = c.series[i];
    std::string pts;
    std::string dots;
    for (auto [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y) || (c.log_x && x <= 0)) continue;
      pts += fmt::format("{},{} ", num(px(x)), num(py(y)));
      dots += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"><title>{}: {} at {}</title></circle>",
                          num(px(x)), num(py(y)), palette(i), esc(s.name), esc(format_figure(y)),
                          esc(tick_label(x, c.x_format)));
    }
    out += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}/>", pts, palette(i),
                       dash_attr(i, s.dashed));
    out += dots;
  }
  for (const auto& m : c.markers) {
    if (!std::isfinite(m.x) || (c.log_x && m.x <= 0)) continue;
    double x = px(m.x);
    bool right_half = x > (f.x0 + f.x1) / 2;
    out += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#b00020\" stroke-width=\"2\" "
        "stroke-dasharray=\"6 3\"/><text x=\"{3}\" y=\"{4}\" fill=\"#b00020\" font-weight=\"600\" "
        "text-anchor=\"{5}\">{6}</text>",
        num(x), num(f.y0), num(f.y1), num(right_half ? x - 5 : x + 5), num(f.y0 + 16),
        right_half ? "end" : "start", esc(m.label));
  }
  out += legend(names, dashed, f.y1 + kBottom + 14, true);
  out += "</svg>";
  return out;
}

std::string heat_map(const HeatMap& h) {
  const std::size_t n = h.cells.size();
  const double left = 64, top = 70;
  const double cell = n ? std::min(44.0, (kWidth - left - 20) / static_cast<double>(n)) : 40;
  const double grid = cell * static_cast<double>(n);
  const double height = top + grid + 78;
  std::string out = open_svg(height, h.title);
  if (n == 0) return out + no_data(top + 20) + "</svg>";

  double lo = INFINITY, hi = -INFINITY;
  for (const auto& row : h.cells)
    for (const auto& v : row)
      if (v && std::isfinite(*v)) {
        lo = std::min(lo, *v);
        hi = std::max(hi, *v);
      }
  const bool measured = std::isfinite(lo);
  if (!measured) lo = 0, hi = 1;
  // Every pair the same (one pair: two ranks): one colour, and a legend of
  // that one value rather than a range nothing was measured in.
  const bool flat = measured && hi <= lo;
  if (hi <= lo) hi = lo + 1;
  // Light to dark blue: more bandwidth is darker.
  auto colour = [&](double v) {
    double t = flat ? 1.0 : std::clamp((v - lo) / (hi - lo), 0.0, 1.0);
    int r = static_cast<int>(std::lround(239 + (8 - 239) * t));
    int g = static_cast<int>(std::lround(243 + (69 - 243) * t));
    int b = static_cast<int>(std::lround(255 + (148 - 255) * t));
    return std::pair{fmt::format("#{:02x}{:02x}{:02x}", r, g, b), t > 0.55};
  };
  const std::size_t label_every = n <= 16 ? 1 : (n + 15) / 16;
  const bool values_inside = n <= 12;
  for (std::size_t i = 0; i < n; ++i) {
    double y = top + cell * static_cast<double>(i);
    if (i % label_every == 0)
      out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>", num(left - 6),
                         num(y + cell / 2 + 4), i);
    for (std::size_t j = 0; j < h.cells[i].size() && j < n; ++j) {
      double x = left + cell * static_cast<double>(j);
      const auto& v = h.cells[i][j];
      if (!v || !std::isfinite(*v)) {
        out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#d9d9d9\"/>", num(x), num(y),
                           num(cell), num(cell));
        continue;
      }
      auto [fill, dark] = colour(*v);
      out += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#fff\"><title>{} {} -> {}: "
          "{}</title></rect>",
          num(x), num(y), num(cell), num(cell), fill, esc(h.row_label), i, j, esc(format_figure(*v)));
      if (values_inside)
        out += fmt::format("<text class=\"cell\" x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" fill=\"{}\">{}</text>",
                           num(x + cell / 2), num(y + cell / 2 + 4), num(std::min(12.0, cell / 3.2)),
                           dark ? "#fff" : "#222", esc(format_figure(*v, 3)));
    }
  }
  for (std::size_t j = 0; j < n; j += label_every)
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                       num(left + cell * (static_cast<double>(j) + 0.5)), num(top - 6), j);
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", num(left + grid / 2), num(top - 22),
                     esc(h.column_label));
  out += fmt::format("<text transform=\"translate(18 {}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
                     num(top + grid / 2), esc(h.row_label));
  for (auto [i, j] : h.highlighted) {
    if (i < 0 || j < 0 || static_cast<std::size_t>(i) >= n || static_cast<std::size_t>(j) >= n) continue;
    out += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#d00000\" stroke-width=\"3\"/>",
        num(left + cell * j + 1.5), num(top + cell * i + 1.5), num(cell - 3), num(cell - 3));
  }
  // Legend: the colour scale and what the red outline means.
  double ly = top + grid + 24;
  if (flat) {
    out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"18\" height=\"12\" fill=\"{}\"/>", num(left), num(ly),
                       colour(lo).first);
    out += fmt::format("<text x=\"{}\" y=\"{}\">every pair {}</text>", num(left), num(ly + 28),
                       esc(format_figure(lo, 3)));
  } else {
    for (int k = 0; k < 10; ++k)
      out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"18\" height=\"12\" fill=\"{}\"/>", num(left + 18.0 * k),
                         num(ly), colour(lo + (hi - lo) * k / 9.0).first);
    out += fmt::format("<text x=\"{}\" y=\"{}\">{}</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
                       num(left), num(ly + 28), esc(format_figure(lo, 3)), num(left + 180), num(ly + 28),
                       esc(format_figure(hi, 3)));
  }
  out += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>", num(left + 190), num(ly + 11), esc(h.value_label));
  if (!h.highlighted.empty())
    out += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"18\" height=\"12\" fill=\"none\" stroke=\"#d00000\" stroke-width=\"3\"/>"
        "<text x=\"{}\" y=\"{}\">slow pair</text>",
        num(left + 190), num(ly + 18), num(left + 214), num(ly + 29));
  out += "</svg>";
  return out;
}

std::string stacked_bars(const StackedBars& b) {
  const double height = kTop + kPlotHeight + kBottom + legend_height(b.parts.size());
  std::string out = open_svg(height, b.title);
  Frame f;
  double hi = 0;
  for (const auto& bar : b.values) {
    double s = 0;
    for (double v : bar) s += std::max(0.0, v) / b.value_scale;
    hi = std::max(hi, s);
  }
  if (b.bars.empty()) return out + y_axis(f, {}, 0, 1, b.y_label) + no_data((f.y0 + f.y1) / 2) + "</svg>";
  double lo = 0;
  hi = hi > 0 ? std::min(hi * 1.05, std::numeric_limits<double>::max()) : 1;
  auto yt = nice_ticks(lo, hi);
  out += y_axis(f, yt, lo, hi, b.y_label);
  out += x_title(f, b.x_label);
  const double slot = (f.x1 - f.x0) / static_cast<double>(b.bars.size());
  const double width = std::min(60.0, slot * 0.7);
  const std::size_t label_every = b.bars.size() <= 24 ? 1 : (b.bars.size() + 23) / 24;
  for (std::size_t i = 0; i < b.bars.size(); ++i) {
    double cx = f.x0 + slot * (static_cast<double>(i) + 0.5);
    double acc = 0;
    for (std::size_t p = 0; i < b.values.size() && p < b.values[i].size(); ++p) {
      double v = std::max(0.0, b.values[i][p]) / b.value_scale;
      if (v <= 0) continue;
      double ytop = f.y1 - (acc + v - lo) / (hi - lo) * (f.y1 - f.y0);
      double ybot = f.y1 - (acc - lo) / (hi - lo) * (f.y1 - f.y0);
      out += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>{} {}: {} {}</title></rect>",
          num(cx - width / 2), num(ytop), num(width), num(std::max(0.5, ybot - ytop)), palette(p), esc(b.bars[i]),
          esc(p < b.parts.size() ? b.parts[p] : ""), esc(format_figure(v)), esc(b.y_label));
      acc += v;
    }
    if (i % label_every == 0)
      out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", num(cx), num(f.y1 + 18),
                         esc(b.bars[i]));
  }
  out += legend(b.parts, {}, f.y1 + kBottom + 14, false);
  out += "</svg>";
  return out;
}

std::string timeline(const Timeline& t) {
  const double lane_h = 24;
  const double top = kTop + 6;
  std::vector<std::string> phases;
  std::map<std::string, std::size_t> phase_index;
  for (const auto& s : t.spans)
    if (phase_index.emplace(s.name, phases.size()).second) phases.push_back(s.name);
  const double plot_h = lane_h * static_cast<double>(std::max<std::size_t>(1, t.lanes.size()));
  const double height = top + plot_h + kBottom + legend_height(phases.size());
  std::string out = open_svg(height, t.title);
  Frame f;
  f.y0 = top;
  f.y1 = top + plot_h;
  double lo = 0, hi = 0;
  for (const auto& s : t.spans) {
    if (!std::isfinite(s.start) || !std::isfinite(s.end)) continue;  // not drawn
    lo = std::min(lo, s.start);
    hi = std::max(hi, s.end);
  }
  if (t.spans.empty()) return out + no_data(top + 20) + "</svg>";
  if (hi <= lo) hi = lo + 1;
  auto ticks = nice_ticks(lo, hi, 6);
  auto px = [&](double x) { return f.x0 + (x - lo) / (hi - lo) * (f.x1 - f.x0); };
  for (double v : ticks) {
    out += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#e3e3e3\"/>", num(px(v)),
                       num(f.y0), num(f.y1));
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", num(px(v)), num(f.y1 + 18),
                       esc(format_figure(v, 3)));
  }
  for (std::size_t i = 0; i < t.lanes.size(); ++i)
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>", num(f.x0 - 6),
                       num(f.y0 + lane_h * static_cast<double>(i) + lane_h / 2 + 4), esc(t.lanes[i]));
  for (const auto& s : t.spans) {
    if (s.lane >= t.lanes.size() || !std::isfinite(s.start) || !std::isfinite(s.end)) continue;
    double y = f.y0 + lane_h * static_cast<double>(s.lane) + 3;
    out += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>{} {}: {} .. {}</title></rect>",
        num(px(s.start)), num(y), num(std::max(1.0, px(s.end) - px(s.start))), num(lane_h - 6),
        palette(phase_index[s.name]), esc(t.lanes[s.lane]), esc(s.name), esc(format_figure(s.start)),
        esc(format_figure(s.end)));
  }
  out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>", num(f.x0),
                     num(f.y0), num(f.x1 - f.x0), num(f.y1 - f.y0));
  out += x_title(f, t.x_label);
  out += legend(phases, {}, f.y1 + kBottom + 14, false);
  out += "</svg>";
  return out;
}

}  // namespace ddpdiag::reports::svg
