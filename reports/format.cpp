#include "reports/format.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

namespace ddpdiag::reports {

std::string human_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", bytes);
  return fmt::format("{} {}", format_figure(bytes, 3), units[u]);
}

std::string short_bytes(double bytes) {
  static const char* units[] = {"", "K", "M", "G", "T"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{}{}", format_figure(bytes, 3), units[u]);
}

std::string format_figure(double v, int digits) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  if (v == 0) return "0";
  double a = std::fabs(v);
  // Large figures (byte counts, times in µs) whole, as 12359680 rather than
  // 1.236e+07; only beyond what a reader counts digits of in exponent form.
  if (a >= 1e7 && a < 1e15) return fmt::format("{:.0f}", v);
  if (a >= 1e7 || a < 1e-4) return fmt::format("{:.{}g}", v, digits);
  // Digits after the point so that about `digits` significant ones show.
  int before = a >= 1 ? static_cast<int>(std::floor(std::log10(a))) + 1 : 0;
  int after = std::max(0, digits - before);
  if (a < 1) after = digits - 1 - static_cast<int>(std::floor(std::log10(a)));
  std::string s = fmt::format("{:.{}f}", v, after);
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  return s;
}

std::string format_cell(const nlohmann::json& v) {
  if (v.is_null()) return "-";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_number_integer()) return v.dump();
  if (v.is_number()) return format_figure(v.get<double>());
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

namespace {

// The length of the control character at s[i] (1 for C0 and DEL, 2 for a C1
// character in UTF-8), or 0.
std::size_t control_at(const std::string& s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x20 || c == 0x7f) return 1;
  if (c == 0xc2 && i + 1 < s.size()) {
    const auto n = static_cast<unsigned char>(s[i + 1]);
    if (n >= 0x80 && n <= 0x9f) return 2;
  }
  return 0;
}

std::string control_text(const std::string& s, std::size_t i, std::size_t len) {
  return len == 1 ? fmt::format("\\x{:02x}", static_cast<unsigned char>(s[i]))
                  : fmt::format("\\u{:04x}", static_cast<unsigned char>(s[i + 1]));
}

}  // namespace

std::string escape_controls(const std::string& s, bool keep_lines) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    const std::size_t len = control_at(s, i);
    if (len == 0 || (keep_lines && (s[i] == '\n' || s[i] == '\t'))) {
      out += s[i];
      continue;
    }
    out += control_text(s, i, len);
    i += len - 1;
  }
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

bool ascii_alnum(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

}  // namespace

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string markdown_text(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const char prev = i > 0 ? s[i - 1] : ' ', next = i + 1 < s.size() ? s[i + 1] : '\0';
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '`': out += "\\`"; break;
      // Links and images ([t](u), ![a](u)), emphasis, strikethrough (~~s~~).
      case '[':
      case ']':
      case '!':
      case '~':
      case '*': out += '\\'; out += c; break;
      // _ inside a word (busbw_gbps) opens no emphasis and stays as it is.
      case '_':
        if (!(ascii_alnum(prev) && ascii_alnum(next))) out += '\\';
        out += c;
        break;
      // A backslash escapes the punctuation after it, or ends a line at the
      // end of the text: doubled there; before a letter, digit or space it
      // is shown as it is (src \ dst).
      case '\\':
        out += ascii_alnum(next) || next == ' ' ? "\\" : "\\\\";
        break;
      case '\n':
      case '\r':
      case '\t': out += ' '; break;
      default:
        if (const std::size_t len = control_at(s, i)) {
          out += control_text(s, i, len);
          i += len - 1;
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string markdown_cell(const std::string& s) {
  std::string out;
  for (char c : markdown_text(s)) {
    if (c == '|')
      out += "\\|";
    else
      out += c;
  }
  return out;
}

std::string markdown_code_cell(const std::string& s) {
  // The fence is one backtick longer than the longest run inside; GitHub
  // takes \| in a table cell as a pipe even within code.
  std::size_t longest = 0, run = 0;
  std::string body;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    run = c == '`' ? run + 1 : 0;
    longest = std::max(longest, run);
    if (c == '|') body += "\\|";
    else if (c == '\n' || c == '\r' || c == '\t') body += ' ';
    else if (const std::size_t len = control_at(s, i)) {
      body += control_text(s, i, len);
      i += len - 1;
    } else body += c;
  }
  const std::string fence(longest + 1, '`');
  const bool pad = !body.empty() && (body.front() == '`' || body.back() == '`');
  return fence + (pad ? " " : "") + body + (pad ? " " : "") + fence;
}

}  // namespace ddpdiag::reports
