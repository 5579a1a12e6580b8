"""QtCharts helpers shared by the dashboard tabs.

`ChartPanel` is a chart with a placeholder message for when there is nothing to
draw. `TimeChart` is a chart over a date-time axis with named line and stacked
area series whose points can be read back (`points(name)`), which is how the
tests check that the numbers on screen are the query results.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from app.qt import Qt, QtCharts, QtCore, QtGui, QtWidgets

PALETTE = {
    "blue": "#1c7ed6",
    "orange": "#f76707",
    "green": "#2f9e44",
    "red": "#e03131",
    "violet": "#7048e8",
    "teal": "#0ca678",
    "grey": "#868e96",
    "yellow": "#f59f00",
    "cyan": "#1098ad",
    "pink": "#d6336c",
}
SERIES_COLORS = ["blue", "orange", "green", "violet", "teal", "pink", "cyan", "red"]
LEVEL_COLORS = {"low": QtGui.QColor(250, 176, 5, 60), "critical": QtGui.QColor(224, 49, 49, 70)}


def color(name: str) -> QtGui.QColor:
    return QtGui.QColor(PALETTE.get(name, name))


def new_chart(title: str = "") -> QtCharts.QChart:
    chart = QtCharts.QChart()
    chart.setTitle(title)
    f = chart.titleFont()
    f.setBold(True)
    f.setPointSizeF(max(9.0, f.pointSizeF()))
    chart.setTitleFont(f)
    chart.legend().setAlignment(Qt.AlignmentFlag.AlignBottom)
    chart.setMargins(QtCore.QMargins(4, 4, 4, 4))
    chart.layout().setContentsMargins(0, 0, 0, 0)
    chart.setBackgroundRoundness(0)
    chart.setAnimationOptions(QtCharts.QChart.AnimationOption.NoAnimation)
    return chart


class ChartPanel(QtWidgets.QWidget):
    """A chart view, or a centered message when there is no data."""

    def __init__(self, chart: QtCharts.QChart, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.chart = chart
        self.view = QtCharts.QChartView(chart)
        self.view.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        self.view.setMinimumHeight(150)
        self.message = QtWidgets.QLabel()
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setWordWrap(True)
        self.message.setObjectName("placeholder")
        self.message.setStyleSheet("color: #666; padding: 16px;")
        self.stack = QtWidgets.QStackedLayout(self)
        self.stack.setContentsMargins(0, 0, 0, 0)
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.message)

    def show_chart(self) -> None:
        self.stack.setCurrentWidget(self.view)

    def show_message(self, text: str) -> None:
        title = self.chart.title()
        self.message.setText(f"<b>{title}</b><br><br>{text}" if title else text)
        self.stack.setCurrentWidget(self.message)

    @property
    def showing_message(self) -> bool:
        return self.stack.currentWidget() is self.message


def _points(pts: Iterable[tuple[float, float]]) -> list[QtCore.QPointF]:
    return [QtCore.QPointF(x * 1000.0, y) for x, y in pts]


class TimeChart(ChartPanel):
    """Lines and stacked areas over wall-clock time (x in epoch seconds)."""

    def __init__(
        self,
        title: str,
        y_title: str,
        *,
        y_range: tuple[float, float] | None = None,
        y_format: str = "%.0f",
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(new_chart(title), parent)
        self.axis_x = QtCharts.QDateTimeAxis()
        self.axis_x.setFormat("HH:mm")
        self.axis_x.setTickCount(7)
        self.axis_y = QtCharts.QValueAxis()
        self.axis_y.setTitleText(y_title)
        self.axis_y.setLabelFormat(y_format)
        self.fixed_y = y_range
        if y_range is not None:
            self.axis_y.setRange(*y_range)
        self.chart.addAxis(self.axis_x, Qt.AlignmentFlag.AlignBottom)
        self.chart.addAxis(self.axis_y, Qt.AlignmentFlag.AlignLeft)
        self.lines: dict[str, QtCharts.QXYSeries] = {}
        self.areas: dict[str, QtCharts.QAreaSeries] = {}
        self._bands: list[QtCharts.QAreaSeries] = []
        self._band_lines: list[QtCharts.QLineSeries] = []
        self._stack: list[str] = []

    # ------------------------------------------------------------ series
    def _attach(self, series: QtCharts.QAbstractSeries) -> None:
        self.chart.addSeries(series)
        series.attachAxis(self.axis_x)
        series.attachAxis(self.axis_y)

    def add_line(self, name: str, color_name: str, *, points: bool = False) -> None:
        s = QtCharts.QLineSeries()
        s.setName(name)
        pen = QtGui.QPen(color(color_name))
        pen.setWidthF(2.0)
        s.setPen(pen)
        s.setPointsVisible(points)
        self.lines[name] = s
        self._attach(s)

    def add_stacked_area(self, name: str, color_name: str) -> None:
        """An area stacked on the previously added one (the first sits on zero)."""
        upper = QtCharts.QLineSeries()
        lower = self.areas[self._stack[-1]].upperSeries() if self._stack else None
        area = (
            QtCharts.QAreaSeries(upper, lower) if lower is not None else QtCharts.QAreaSeries(upper)
        )
        area.setName(name)
        c = color(color_name)
        pen = QtGui.QPen(c.darker(120))
        pen.setWidthF(1.0)
        area.setPen(pen)
        fill = QtGui.QColor(c)
        fill.setAlpha(170)
        area.setBrush(fill)
        self.areas[name] = area
        self.lines[name] = upper
        self._stack.append(name)
        self._attach(area)

    def set_line(self, name: str, pts: Sequence[tuple[float, float]]) -> None:
        self.lines[name].replace(_points(pts))

    def set_stacked(self, values: dict[str, Sequence[tuple[float, float]]]) -> None:
        """Set stacked areas from their own values (not cumulative); x must line up."""
        running: list[list[float]] = []
        for name in self._stack:
            pts = list(values.get(name, []))
            if not running:
                running = [[x, y] for x, y in pts]
            else:
                for acc, (_, y) in zip(running, pts, strict=True):
                    acc[1] += y
            self.lines[name].replace(_points((x, y) for x, y in running))

    def points(self, name: str) -> list[tuple[float, float]]:
        """(epoch seconds, y) of a series as drawn (areas: their upper edge)."""
        return [(p.x() / 1000.0, p.y()) for p in self.lines[name].points()]

    # ------------------------------------------------------------ axes and bands
    def set_x_range(self, t0: float, t1: float) -> None:
        span = t1 - t0
        fmt = "HH:mm" if span <= 36 * 3600 else ("MMM d HH:mm" if span <= 4 * 86400 else "MMM d")
        self.axis_x.setFormat(fmt)
        self.axis_x.setRange(
            QtCore.QDateTime.fromMSecsSinceEpoch(int(t0 * 1000)),
            QtCore.QDateTime.fromMSecsSinceEpoch(int(t1 * 1000)),
        )

    def fit_y(self, *, floor: float = 0.0, minimum_top: float = 1.0) -> None:
        if self.fixed_y is not None:
            return
        top = minimum_top
        for s in self.lines.values():
            for p in s.points():
                top = max(top, p.y())
        self.axis_y.setRange(floor, _nice_ceiling(top * 1.08))

    def set_bands(self, runs: Sequence[tuple[float, float, str]]) -> None:
        """Shade (t0, t1, level) spans across the whole plot (pressure level bands)."""
        for area in self._bands:
            self.chart.removeSeries(area)
        self._bands.clear()
        self._band_lines.clear()
        lo, hi = self.axis_y.min(), self.axis_y.max()
        seen: set[str] = set()
        for t0, t1, level in runs:
            up = QtCharts.QLineSeries()
            down = QtCharts.QLineSeries()
            up.replace(_points([(t0, hi), (t1, hi)]))
            down.replace(_points([(t0, lo), (t1, lo)]))
            area = QtCharts.QAreaSeries(up, down)
            area.setName(f"pressure {level}")
            area.setBrush(LEVEL_COLORS.get(level, QtGui.QColor(0, 0, 0, 30)))
            area.setPen(QtGui.QPen(Qt.PenStyle.NoPen))
            self._band_lines += [up, down]
            self._bands.append(area)
            self._attach(area)
            marker = self.chart.legend().markers(area)
            if level in seen:
                for m in marker:
                    m.setVisible(False)
            seen.add(level)

    @property
    def bands(self) -> list[tuple[float, float, str]]:
        out = []
        for area in self._bands:
            pts = area.upperSeries().points()
            out.append((pts[0].x() / 1000.0, pts[-1].x() / 1000.0, area.name().split()[-1]))
        return out


def _nice_ceiling(v: float) -> float:
    if v <= 0:
        return 1.0
    import math

    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * exp >= v:
            return m * exp
    return 10 * exp


class BarChart(ChartPanel):
    """Horizontal bars with value labels: one set, named categories."""

    def __init__(
        self,
        title: str,
        value_title: str,
        *,
        color_name: str = "blue",
        label_format: str = "@value",
        value_range: tuple[float, float] | None = None,
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(new_chart(title), parent)
        self.chart.legend().setVisible(False)
        self.series = QtCharts.QHorizontalBarSeries()
        self.series.setLabelsVisible(True)
        self.series.setLabelsFormat(label_format)
        self.series.setLabelsPosition(QtCharts.QAbstractBarSeries.LabelsPosition.LabelsInsideEnd)
        self.set = QtCharts.QBarSet(value_title)
        self.set.setColor(color(color_name))
        self.set.setLabelColor(QtGui.QColor("white"))
        self.series.append(self.set)
        self.chart.addSeries(self.series)
        self.axis_cat = QtCharts.QBarCategoryAxis()
        self.axis_val = QtCharts.QValueAxis()
        self.axis_val.setTitleText(value_title)
        self.axis_val.setLabelFormat("%.0f")
        self.value_range = value_range
        self.chart.addAxis(self.axis_cat, Qt.AlignmentFlag.AlignLeft)
        self.chart.addAxis(self.axis_val, Qt.AlignmentFlag.AlignBottom)
        self.series.attachAxis(self.axis_cat)
        self.series.attachAxis(self.axis_val)

    def set_bars(self, bars: Sequence[tuple[str, float]]) -> None:
        # Categories read bottom-up on a horizontal chart: reverse so the first is on top.
        bars = list(reversed(bars))
        self.set.remove(0, self.set.count())
        self.set.append([float(v) for _, v in bars])
        self.axis_cat.clear()
        self.axis_cat.append([c for c, _ in bars])
        if self.value_range is not None:
            self.axis_val.setRange(*self.value_range)
        else:
            top = max([v for _, v in bars] + [1.0])
            self.axis_val.setRange(0, _nice_ceiling(top * 1.1))

    def bars(self) -> list[tuple[str, float]]:
        cats = self.axis_cat.categories()
        vals = [self.set.at(i) for i in range(self.set.count())]
        return list(reversed(list(zip(cats, vals, strict=True))))
