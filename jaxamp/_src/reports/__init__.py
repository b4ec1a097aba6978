"""Reports: explain, precision_report, nonfinite_report and the coverage table."""
