// SVG line charts (see chart.h): one <polyline> per panel in a frame with min/max tick labels.
#include "chunkloss/apps/chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace chunkloss::apps {

namespace {

constexpr double kPanelW = 440, kPanelH = 300, kLeft = 64, kRight = 16, kTop = 56, kBottom = 44;

std::string escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string text(double x, double y, const std::string& s, const char* anchor, int size = 12) {
  return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" font-size=\"" + std::to_string(size) +
         "\" text-anchor=\"" + anchor + "\">" + escape(s) + "</text>\n";
}

std::string panel(const ChartPanel& p, double x0, const std::string& x_label) {
  const double pw = kPanelW - kLeft - kRight, ph = kPanelH - kTop - kBottom;
  const double left = x0 + kLeft, top = kTop, bottom = kTop + ph;
  std::string s = text(x0 + kPanelW / 2, 40, p.title, "middle", 14);
  s += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(pw) + "\" height=\"" +
       num(ph) + "\" fill=\"none\" stroke=\"#888\"/>\n";
  std::vector<std::pair<double, double>> pts;
  for (const auto& q : p.points)
    if (std::isfinite(q.first) && std::isfinite(q.second)) pts.push_back(q);
  if (pts.empty()) return s + text(left + pw / 2, top + ph / 2, "no data", "middle");
  double xmin = pts.front().first, xmax = xmin, ymin = pts.front().second, ymax = ymin;
  for (const auto& [x, y] : pts) {
    xmin = std::min(xmin, x);
    xmax = std::max(xmax, x);
    ymin = std::min(ymin, y);
    ymax = std::max(ymax, y);
  }
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) ymax = ymin + 1;
  const auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * pw; };
  const auto py = [&](double y) { return bottom - (y - ymin) / (ymax - ymin) * ph; };
  s += "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
  for (const auto& [x, y] : pts) s += num(px(x)) + "," + num(py(y)) + " ";
  s += "\"/>\n";
  s += text(left - 6, top + 4, num(ymax), "end");
  s += text(left - 6, bottom + 4, num(ymin), "end");
  s += text(left, bottom + 18, num(xmin), "start");
  s += text(left + pw, bottom + 18, num(xmax), "end");
  s += text(left + pw / 2, bottom + 34, x_label, "middle");
  return s;
}

}  // namespace

std::string svg_chart(const std::string& title, const std::string& x_label,
                      const std::vector<ChartPanel>& panels) {
  const double width = kPanelW * static_cast<double>(std::max<std::size_t>(1, panels.size()));
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) +
                  "\" height=\"" + num(kPanelH) + "\" viewBox=\"0 0 " + num(width) + " " +
                  num(kPanelH) + "\" font-family=\"sans-serif\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += text(width / 2, 20, title, "middle", 15);
  for (std::size_t i = 0; i < panels.size(); ++i)
    s += panel(panels[i], kPanelW * static_cast<double>(i), x_label);
  return s + "</svg>\n";
}

}  // namespace chunkloss::apps
