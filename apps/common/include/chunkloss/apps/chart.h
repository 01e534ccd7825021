// A dependency-free SVG line chart: panels side by side, each one curve of y over x with its
// axis ranges labelled, for the training apps' loss and accuracy curves.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace chunkloss::apps {

/// One panel: a title and the points of its curve (x ascending; non-finite y are skipped).
struct ChartPanel {
  std::string title;
  std::vector<std::pair<double, double>> points;
};

/// The SVG document: the panels in one row under `title`, x labelled `x_label`. A panel
/// without finite points says "no data".
std::string svg_chart(const std::string& title, const std::string& x_label,
                      const std::vector<ChartPanel>& panels);

}  // namespace chunkloss::apps
