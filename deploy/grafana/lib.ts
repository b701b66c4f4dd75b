// Helpers of the dgserve Grafana dashboard (dashboard.ts): the Prometheus query builders, the
// panel builders (time series, stat, heatmap) typed with @grafana/schema's panel plugins, the
// row layout on the 24-column grid, and the metric name prefixes. Split from dashboard.ts to
// keep each file short; build.mjs evaluates both.
import {
  type DataQuery,
  type DataSourceRef,
  type FieldConfigSource,
  type Panel,
  type RowPanel,
  type ThresholdsConfig,
  AxisPlacement,
  BigValueColorMode,
  BigValueGraphMode,
  BigValueJustifyMode,
  BigValueTextMode,
  GraphDrawStyle,
  GraphThresholdsStyleMode,
  HeatmapCellLayout,
  LegendDisplayMode,
  PercentChangeColorMode,
  ScaleDistribution,
  SortOrder,
  ThresholdsMode,
  TooltipDisplayMode,
  VisibilityMode,
  VizOrientation,
} from '@grafana/schema';
import type {
  FieldConfig as TimeSeriesFieldConfig,
  Options as TimeSeriesOptions,
} from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';
import {
  type FieldConfig as HeatmapFieldConfig,
  type Options as HeatmapOptions,
  HeatmapColorMode,
  HeatmapColorScale,
} from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen';
import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';

// ---- queries ----

export const DS: DataSourceRef = { type: 'prometheus', uid: '${datasource}' };

/** A Prometheus query target (the Prometheus data source's query model). */
export type PromQuery = Pick<DataQuery, 'refId' | 'datasource' | 'hide'> & {
  expr: string;
  legendFormat?: string;
  format?: 'time_series' | 'heatmap' | 'table';
  range?: boolean;
  instant?: boolean;
};

/** The job/instance filter every selector carries. */
export const FILTER = 'job=~"$job", instance=~"$instance"';
/** `name{job=~"$job", instance=~"$instance", <extra>}` */
export const sel = (name: string, extra = ''): string => `${name}{${FILTER}${extra ? `, ${extra}` : ''}}`;
/** Per-second rate of a counter (or histogram series) over Grafana's rate interval. */
export const rate = (name: string, extra = ''): string => `rate(${sel(name, extra)}[$__rate_interval])`;
/** Quantile q of a histogram (base name without _bucket), aggregated over the `by` labels. */
export const quantile = (q: number, hist: string, by: string[] = [], extra = ''): string =>
  `histogram_quantile(${q}, sum by (${[...by, 'le'].join(', ')}) (${rate(`${hist}_bucket`, extra)}))`;
/** Mean of a histogram's observations over the rate interval: sum / count. */
export const mean = (hist: string): string => `sum(${rate(`${hist}_sum`)}) / sum(${rate(`${hist}_count`)})`;

export type Q = { expr: string; legend: string; format?: PromQuery['format'] };
export const toTargets = (qs: Q[]): PromQuery[] =>
  qs.map((q, i) => ({
    refId: String.fromCharCode(65 + i),
    datasource: DS,
    expr: q.expr,
    legendFormat: q.legend,
    range: true,
    ...(q.format ? { format: q.format } : {}),
  }));

// ---- panels ----
//
// The schema types a panel's `options` and `fieldConfig.defaults.custom` as
// Record<string, unknown>; each helper builds them as the panel plugin's own typed Options /
// FieldConfig (from @grafana/schema's panelcfg modules) and spreads them in.

export interface PanelSpec {
  title: string;
  description: string;
  queries: Q[];
  unit?: string;
  min?: number;
  max?: number;
  decimals?: number;
  /** A red threshold (drawn as a dashed line on time series). */
  redAbove?: number;
  overrides?: FieldConfigSource['overrides'];
}

export const thresholds = (redAbove?: number): ThresholdsConfig => ({
  mode: ThresholdsMode.Absolute,
  steps: [
    { color: 'green', value: null },
    ...(redAbove === undefined ? [] : [{ color: 'red', value: redAbove }]),
  ],
});

export const timeSeriesOptions: TimeSeriesOptions = {
  legend: { calcs: ['mean', 'max', 'lastNotNull'], displayMode: LegendDisplayMode.Table, placement: 'bottom', showLegend: true },
  tooltip: { mode: TooltipDisplayMode.Multi, sort: SortOrder.Descending },
};

export function timeseries(s: PanelSpec): Panel {
  const custom: TimeSeriesFieldConfig = {
    drawStyle: GraphDrawStyle.Line,
    lineWidth: 1,
    fillOpacity: 10,
    showPoints: VisibilityMode.Never,
    spanNulls: false,
    axisPlacement: AxisPlacement.Auto,
    thresholdsStyle: {
      mode: s.redAbove === undefined ? GraphThresholdsStyleMode.Off : GraphThresholdsStyleMode.Dashed,
    },
  };
  return {
    type: 'timeseries',
    title: s.title,
    description: s.description,
    datasource: DS,
    targets: toTargets(s.queries),
    fieldConfig: {
      defaults: {
        unit: s.unit ?? 'short',
        ...(s.min !== undefined ? { min: s.min } : {}),
        ...(s.max !== undefined ? { max: s.max } : {}),
        ...(s.decimals !== undefined ? { decimals: s.decimals } : {}),
        thresholds: thresholds(s.redAbove),
        custom: { ...custom },
      },
      overrides: s.overrides ?? [],
    },
    options: { ...timeSeriesOptions },
  };
}

export function stat(s: PanelSpec): Panel {
  const options: StatOptions = {
    colorMode: BigValueColorMode.Value,
    graphMode: BigValueGraphMode.Area,
    justifyMode: BigValueJustifyMode.Auto,
    orientation: VizOrientation.Auto,
    percentChangeColorMode: PercentChangeColorMode.Standard,
    reduceOptions: { calcs: ['lastNotNull'], fields: '', values: false },
    showPercentChange: false,
    textMode: BigValueTextMode.ValueAndName,
    wideLayout: true,
  };
  return {
    type: 'stat',
    title: s.title,
    description: s.description,
    datasource: DS,
    targets: toTargets(s.queries),
    fieldConfig: {
      defaults: { unit: s.unit ?? 'short', thresholds: thresholds(s.redAbove) },
      overrides: s.overrides ?? [],
    },
    options: { ...options },
  };
}

/** A heatmap of a Prometheus histogram: one cell row per bucket (`le`), counts per interval. */
export function heatmap(s: PanelSpec & { yUnit?: string }): Panel {
  const options: HeatmapOptions = {
    calculate: false,
    cellGap: 1,
    color: {
      mode: HeatmapColorMode.Scheme,
      scheme: 'Oranges',
      scale: HeatmapColorScale.Exponential,
      exponent: 0.5,
      fill: 'dark-orange',
      reverse: false,
      steps: 64,
    },
    exemplars: { color: 'rgba(255,0,255,0.7)' },
    filterValues: { le: 1e-9 },
    legend: { show: true },
    rowsFrame: { layout: HeatmapCellLayout.le },
    showValue: VisibilityMode.Auto,
    tooltip: { mode: TooltipDisplayMode.Single, yHistogram: true, showColorScale: false },
    yAxis: { axisPlacement: AxisPlacement.Left, reverse: false, unit: s.yUnit ?? 'short' },
  };
  const custom: HeatmapFieldConfig = {
    hideFrom: { legend: false, tooltip: false, viz: false },
    scaleDistribution: { type: ScaleDistribution.Linear },
  };
  return {
    type: 'heatmap',
    title: s.title,
    description: s.description,
    datasource: DS,
    targets: toTargets(s.queries),
    maxDataPoints: 100,
    fieldConfig: { defaults: { custom: { ...custom } }, overrides: [] },
    options: { ...options },
  };
}

/** Overrides that move the series named `name` to a right-hand axis with its own unit. */
export const rightAxis = (name: string, unit: string): FieldConfigSource['overrides'] => [
  {
    matcher: { id: 'byName', options: name },
    properties: [
      { id: 'custom.axisPlacement', value: AxisPlacement.Right },
      { id: 'unit', value: unit },
    ],
  },
];

// ---- layout: rows of panels, placed left to right on Grafana's 24-column grid ----

export type Sized = { panel: Panel; w: number; h?: number };

export function layout(rows: Array<{ title: string; panels: Sized[] }>): Array<Panel | RowPanel> {
  const out: Array<Panel | RowPanel> = [];
  let id = 1;
  let y = 0;
  for (const row of rows) {
    const rowPanel: RowPanel = {
      type: 'row',
      id: id++,
      title: row.title,
      collapsed: false,
      gridPos: { h: 1, w: 24, x: 0, y },
      panels: [],
    };
    out.push(rowPanel);
    y += 1;
    let x = 0;
    let lineHeight = 0;
    for (const { panel, w, h = 8 } of row.panels) {
      if (x + w > 24) {
        y += lineHeight;
        x = 0;
        lineHeight = 0;
      }
      out.push({ ...panel, id: id++, gridPos: { h, w, x, y } });
      x += w;
      lineHeight = Math.max(lineHeight, h);
    }
    y += lineHeight;
  }
  return out;
}

// ---- the rows ----

export const GW = 'dgserve_gateway';
export const PF = 'dgserve_prefill';
export const DN = 'dgserve_denoise';
