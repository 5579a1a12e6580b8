"""QtCharts helpers shared by the dashboard tabs, and the colors that follow the palette.

`ChartPanel` is a chart with a placeholder message for when there is nothing to
draw. `TimeChart` is a chart over a date-time axis with named line and stacked
area series whose points can be read back (`points(name)`), which is how the
tests check that the numbers on screen are the query results. `BarChart` names
each bar's value beside its category, where it is never clipped by a short bar.

Charts, captions and warnings take their colors from the widget's palette, so a
dark desktop theme (the platform's palette, `QStyleHints.colorScheme`) gives dark
charts with readable text; they repaint when the palette changes. QtCharts' own
themes are not used: `QChart.setTheme` overwrites every series' colors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from app.fmt import Scale
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


# ------------------------------------------------------------------ palette
def app_palette() -> QtGui.QPalette:
    return QtGui.QGuiApplication.palette()


def is_dark(palette: QtGui.QPalette | None = None) -> bool:
    """Whether `palette` (the application's) draws light text on a dark window."""
    p = palette or app_palette()
    return p.color(QtGui.QPalette.ColorRole.Window).lightness() < 128


def _mix(a: QtGui.QColor, b: QtGui.QColor, t: float) -> QtGui.QColor:
    """`a` moved a fraction `t` of the way to `b`."""
    return QtGui.QColor.fromRgbF(
        a.redF() + (b.redF() - a.redF()) * t,
        a.greenF() + (b.greenF() - a.greenF()) * t,
        a.blueF() + (b.blueF() - a.blueF()) * t,
    )


def _luminance(c: QtGui.QColor) -> float:
    def channel(v: float) -> float:
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(c.redF()) + 0.7152 * channel(c.greenF()) + 0.0722 * channel(c.blueF())


def contrast(a: QtGui.QColor, b: QtGui.QColor) -> float:
    """WCAG contrast ratio of two colors (1 to 21; body text wants at least 4.5)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


MIN_CONTRAST = 4.5


def muted(palette: QtGui.QPalette | None = None, role: str = "window") -> QtGui.QColor:
    """Secondary text (captions, hints): the text color moved toward the background, but
    never below `MIN_CONTRAST` against it."""
    p = palette or app_palette()
    bg = p.color(
        QtGui.QPalette.ColorRole.Base if role == "base" else QtGui.QPalette.ColorRole.Window
    )
    fg = p.color(
        QtGui.QPalette.ColorRole.Text if role == "base" else QtGui.QPalette.ColorRole.WindowText
    )
    for t in (0.4, 0.3, 0.2, 0.1, 0.0):
        c = _mix(fg, bg, t)
        if contrast(c, bg) >= MIN_CONTRAST:
            return c
    return fg


# Warnings and errors: a darker shade on light windows, a lighter one on dark windows.
TONES = {
    "warning": ("#873800", "#ffc078"),
    "error": ("#c92a2a", "#ff8787"),
    "warn": ("#b35900", "#ffa94d"),
    "info": ("#1864ab", "#74c0fc"),
}
# Boxes (a banner, the restart offer): background, border.
BOXES = {
    "warning": (("#fff4e6", "#ffc078"), ("#3d2a12", "#a65d00")),
    "info": (("#e7f5ff", "#74c0fc"), ("#14283b", "#1c7ed6")),
}


def tone(name: str, palette: QtGui.QPalette | None = None) -> QtGui.QColor:
    """A warning/error/info text color readable on the palette's window."""
    light, dark = TONES[name]
    return QtGui.QColor(dark if is_dark(palette) else light)


def box_style(
    name: str, selector: str, palette: QtGui.QPalette | None = None, extra: str = ""
) -> str:
    """A style sheet for a tinted box (`selector` is e.g. ``#restart_box``)."""
    (bg, border) = BOXES[name][1 if is_dark(palette) else 0]
    text = tone(name, palette).name()
    return (
        f"{selector} {{ background: {bg}; color: {text}; border: 1px solid {border};"
        f" border-radius: 3px; {extra}}}"
    )


def text_color(palette: QtGui.QPalette | None = None) -> QtGui.QColor:
    return (palette or app_palette()).color(QtGui.QPalette.ColorRole.Text)


def dark_palette() -> QtGui.QPalette:
    """A dark palette like a desktop's dark theme gives (GNOME's Adwaita-dark, KDE's
    Breeze Dark): for the screenshots and tests on platforms that have no theme of
    their own (offscreen)."""
    r = QtGui.QPalette.ColorRole
    p = QtGui.QPalette()
    for role, c in (
        (r.Window, "#2b2b2b"), (r.WindowText, "#e8e8e8"), (r.Base, "#1f1f1f"),
        (r.AlternateBase, "#292929"), (r.Text, "#e8e8e8"), (r.Button, "#353535"),
        (r.ButtonText, "#e8e8e8"), (r.BrightText, "#ffffff"), (r.Highlight, "#3d7fc1"),
        (r.HighlightedText, "#ffffff"), (r.ToolTipBase, "#353535"), (r.ToolTipText, "#e8e8e8"),
        (r.PlaceholderText, "#9a9a9a"), (r.Link, "#74c0fc"), (r.Light, "#4a4a4a"),
        (r.Midlight, "#3e3e3e"), (r.Mid, "#555555"), (r.Dark, "#1a1a1a"), (r.Shadow, "#000000"),
    ):  # fmt: skip
        p.setColor(role, QtGui.QColor(c))
    g = QtGui.QPalette.ColorGroup.Disabled
    for role in (r.WindowText, r.Text, r.ButtonText):
        p.setColor(g, role, QtGui.QColor("#7a7a7a"))
    return p


def apply_palette(chart: QtCharts.QChart, palette: QtGui.QPalette | None = None) -> None:
    """Color a chart's background, title, axes, grid and legend from `palette`."""
    p = palette or app_palette()
    base = p.color(QtGui.QPalette.ColorRole.Base)
    text = p.color(QtGui.QPalette.ColorRole.Text)
    chart.setBackgroundBrush(QtGui.QBrush(base))
    chart.setBackgroundPen(QtGui.QPen(Qt.PenStyle.NoPen))
    chart.setTitleBrush(QtGui.QBrush(text))
    chart.legend().setLabelColor(text)
    grid = _mix(base, text, 0.16)
    line = _mix(base, text, 0.45)
    for axis in chart.axes():
        axis.setLabelsBrush(QtGui.QBrush(text))
        axis.setTitleBrush(QtGui.QBrush(text))
        axis.setGridLineColor(grid)
        axis.setMinorGridLineColor(_mix(base, text, 0.08))
        axis.setLinePenColor(line)


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
    apply_palette(chart)
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
        self.stack = QtWidgets.QStackedLayout(self)
        self.stack.setContentsMargins(0, 0, 0, 0)
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.message)
        self.follow_palette()

    def follow_palette(self) -> None:
        """Color the chart and the message from the palette (again after it changed)."""
        p = self.palette()
        apply_palette(self.chart, p)
        self.view.setBackgroundBrush(QtGui.QBrush(p.color(QtGui.QPalette.ColorRole.Base)))
        self.message.setStyleSheet(f"color: {muted(p).name()}; padding: 16px;")

    def changeEvent(self, event: QtCore.QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (
            QtCore.QEvent.Type.PaletteChange,
            QtCore.QEvent.Type.ApplicationPaletteChange,
        ):
            self.follow_palette()

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


# Tick steps for a time axis, in seconds: minutes, hours, days.
TICK_STEPS = (
    60, 120, 300, 600, 900, 1800, 3600, 7200, 3 * 3600, 4 * 3600, 6 * 3600, 12 * 3600,
    86400, 2 * 86400, 5 * 86400, 7 * 86400,
)  # fmt: skip
MAX_TICKS = 8


def tick_step(span: float) -> float:
    """The smallest round step that divides `span` into at most `MAX_TICKS` - 1 parts."""
    for step in TICK_STEPS:
        if span / step <= MAX_TICKS - 1:
            return float(step)
    return float(math.ceil(span / (MAX_TICKS - 1) / 86400) * 86400)


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
        self.follow_palette()
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
        """Show [t0, t1], ticks every round step from t0 (03:00, 07:00, … rather than
        03:00, 06:50, 10:41): t1 moves on to the next whole step (less than one)."""
        step = tick_step(t1 - t0)
        n = max(1, math.ceil((t1 - t0) / step - 1e-9))
        t1 = t0 + n * step
        self.axis_x.setTickCount(n + 1)
        span = t1 - t0
        fmt = "HH:mm" if span <= 36 * 3600 else ("MMM d HH:mm" if span <= 4 * 86400 else "MMM d")
        self.axis_x.setFormat(fmt)
        # The last tick's label is centered on the plot's right edge: leave room for its
        # right half, or it is cut ("01:1").
        half = QtGui.QFontMetrics(self.axis_x.labelsFont()).horizontalAdvance(fmt + "0") // 2
        m = self.chart.margins()
        self.chart.setMargins(QtCore.QMargins(m.left(), m.top(), max(4, half), m.bottom()))
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
        self.axis_y.setRange(floor, top * 1.08)
        self.axis_y.applyNiceNumbers()  # ticks on round values (0, 10, 20, 30, not 6.25 steps)

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


class BarChart(ChartPanel):
    """Horizontal bars, one set, named categories; each category's label carries its
    value ("prefill warm (n=3,269) · 6.8 ms"), so a short bar's number stays readable.

    `scale` picks the value axis' unit from the data (`app.fmt.time_scale` for
    milliseconds); `value_text` writes a value for its label.
    """

    def __init__(
        self,
        title: str,
        value_title: str,
        *,
        color_name: str = "blue",
        value_text: Callable[[float], str] = lambda v: f"{v:g}",
        scale: Callable[[float], Scale] | None = None,
        value_range: tuple[float, float] | None = None,
        parent: QtWidgets.QWidget | None = None,
    ) -> None:
        super().__init__(new_chart(title), parent)
        self.chart.legend().setVisible(False)
        self.value_title = value_title
        self.value_text = value_text
        self.make_scale = scale
        self.scale = Scale(1.0, value_title, 0)
        self.series = QtCharts.QHorizontalBarSeries()
        self.series.setLabelsVisible(False)
        self.set = QtCharts.QBarSet(value_title)
        self.set.setColor(color(color_name))
        self.set.setPen(QtGui.QPen(Qt.PenStyle.NoPen))  # no light outline on a dark chart
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
        self._bars: list[tuple[str, float]] = []
        self.follow_palette()

    def set_bars(self, bars: Sequence[tuple[str, float]]) -> None:
        """(name, value) bars, the first on top, values in the data's own unit."""
        self._bars = [(name, float(v)) for name, v in bars]
        top = max([v for _, v in self._bars] + [0.0])
        if self.make_scale is not None:
            self.scale = self.make_scale(top)
            self.axis_val.setTitleText(self.scale.unit)
            self.axis_val.setLabelFormat(self.scale.label_format)
        sc = self.scale
        # Categories read bottom-up on a horizontal chart: reverse so the first is on top.
        shown = list(reversed(self._bars))
        self.set.remove(0, self.set.count())
        self.set.append([sc(v) for _, v in shown])
        self.axis_cat.clear()
        self.axis_cat.append([f"{name} · {self.value_text(v)}" for name, v in shown])
        if self.value_range is not None:
            self.axis_val.setRange(*self.value_range)
        else:
            self.axis_val.setRange(0, max(sc(top), 1.0) * 1.1)
            self.axis_val.applyNiceNumbers()

    def bars(self) -> list[tuple[str, float]]:
        """(name, value) as given to `set_bars`; `labels()` is what the axis shows."""
        drawn = [self.set.at(i) * self.scale.divisor for i in range(self.set.count())]
        assert all(
            abs(a - v) <= 1e-6 * max(1.0, abs(v))
            for a, (_, v) in zip(reversed(drawn), self._bars, strict=True)
        ), "the drawn bars are not the values given"
        return list(self._bars)

    def labels(self) -> list[str]:
        """The category labels, top to bottom."""
        return list(reversed(self.axis_cat.categories()))
