// Validates Prometheus Operator objects (JSON documents on stdin, one array) with the validators
// @kubernetes-models/prometheus-operator generates from the operator's CRDs: prints one line per
// invalid document and exits 1, or exits 0. tests/test_deploy.py runs it on what gatewayctl renders.
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const KINDS = { PodMonitor, PrometheusRule, ServiceMonitor };
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
let failed = 0;
for (const doc of JSON.parse(Buffer.concat(chunks).toString())) {
  const Kind = KINDS[doc.kind];
  try {
    if (doc.apiVersion !== "monitoring.coreos.com/v1" || !Kind) throw new Error(`no model for ${doc.apiVersion} ${doc.kind}`);
    new Kind(doc).validate();
  } catch (e) {
    failed++;
    console.log(`${doc.kind} ${doc.metadata?.name}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
