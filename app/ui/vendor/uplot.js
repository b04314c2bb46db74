// ES-module face of the vendored uPlot 1.6.32 (MIT, see uPlot.LICENSE): index.html loads uPlot.iife.min.js (51 KB,
// the smallest build) as a classic script before any module runs; this re-exports its global.
const uPlot = globalThis.uPlot;
if (!uPlot) throw new Error("uPlot.iife.min.js must be loaded before the dashboard modules");
export default uPlot;
